//! Temporaries for the updates, allocated once per step before any parameter is touched.
use tch::{Device, Kind, Tensor};

/// Flat buffers, per (device, kind), for the temporaries of one parameter's update, sized for
/// the largest parameter and the most temporaries, so that one allocation before the update
/// loop serves every parameter.
#[derive(Default)]
pub struct Workspace {
    wanted: Vec<Wanted>,
    buffers: Vec<(Device, Kind, Vec<Tensor>)>,
}

struct Wanted {
    device: Device,
    kind: Kind,
    temporaries: usize,
    numel: i64,
}

impl Workspace {
    /// Asks for `temporaries` tensors shaped like `p`.
    pub fn reserve(&mut self, p: &Tensor, temporaries: usize) {
        self.reserve_on(p.device(), p, temporaries)
    }

    /// Asks for `temporaries` tensors shaped like `p`, on `device` (the host's buffers are CPU
    /// tensors whatever the parameter's device).
    pub fn reserve_on(&mut self, device: Device, p: &Tensor, temporaries: usize) {
        let (kind, numel) = (p.kind(), p.numel() as i64);
        match self.wanted.iter_mut().find(|w| w.device == device && w.kind == kind) {
            Some(w) => {
                w.numel = w.numel.max(numel);
                w.temporaries = w.temporaries.max(temporaries);
            }
            None => self.wanted.push(Wanted {
                device,
                kind,
                temporaries,
                numel,
            }),
        }
    }

    /// Allocates everything reserved.
    pub fn allocate(&mut self) {
        self.buffers = self
            .wanted
            .iter()
            .map(|w| {
                let bufs = (0..w.temporaries).map(|_| Tensor::empty([w.numel], (w.kind, w.device)));
                (w.device, w.kind, bufs.collect())
            })
            .collect();
    }

    /// Views of the buffers shaped like `p` (views allocate no tensor memory).
    pub fn views(&self, p: &Tensor) -> Vec<Tensor> {
        self.views_on(p.device(), p)
    }

    /// Views of the buffers on `device` shaped like `p`.
    pub fn views_on(&self, d: Device, p: &Tensor) -> Vec<Tensor> {
        let k = p.kind();
        let (_, _, bufs) = self
            .buffers
            .iter()
            .find(|b| b.0 == d && b.1 == k)
            .expect("reserved for every parameter");
        let n = p.numel() as i64;
        let shape = p.size();
        bufs.iter().map(|b| b.narrow(0, 0, n).view(shape.as_slice())).collect()
    }

    /// For a group of parameters of one (device, kind) whose sizes sum to at most the largest
    /// one reserved: `temporaries` lists of views, each parameter's at its own offset.
    pub fn packed(&self, d: Device, k: Kind, params: &[Tensor]) -> Vec<Vec<Tensor>> {
        let (_, _, bufs) = self
            .buffers
            .iter()
            .find(|b| b.0 == d && b.1 == k)
            .expect("reserved for every parameter");
        bufs.iter()
            .map(|b| {
                let mut at = 0;
                params
                    .iter()
                    .map(|p| {
                        let n = p.numel() as i64;
                        let v = b.narrow(0, at, n).view(p.size().as_slice());
                        at += n;
                        v
                    })
                    .collect()
            })
            .collect()
    }
}

/// `grad` copied into the workspace temporary `to`, on the side the update runs.
pub(super) fn carry(to: &Tensor, grad: &Tensor) -> Tensor {
    let mut t = to.shallow_clone();
    t.copy_(grad);
    t
}
