//! c10d through the shim (dist.cpp): a process group over a TCPStore, collectives, and DDP's
//! Reducer. Only in builds that found Gloo's or NCCL's headers (`cfg(memtrain_dist)`); in the
//! others every constructor says what is missing.
use anyhow::Result;
#[cfg(memtrain_dist)]
use std::ffi::{c_char, CString};
use tch::Tensor;
#[cfg(memtrain_dist)]
use torch_sys::C_tensor;

#[cfg(memtrain_dist)]
use super::check;

#[cfg(memtrain_dist)]
#[repr(C)]
struct MtGroup {
    _private: [u8; 0],
}
#[cfg(memtrain_dist)]
#[repr(C)]
struct MtReducer {
    _private: [u8; 0],
}

#[cfg(memtrain_dist)]
extern "C" {
    fn mt_dist_backends() -> i32;
    #[allow(clippy::too_many_arguments)]
    fn mt_dist_group_new(
        host: *const c_char,
        port: i32,
        rank: i32,
        size: i32,
        server: i32,
        prefix: *const c_char,
        cuda: i32,
        device: i64,
        gloo_ifaces: *const c_char,
        gloo_host: *const c_char,
        timeout_ms: i64,
        out: *mut *mut MtGroup,
    ) -> *mut c_char;
    fn mt_dist_group_free(g: *mut MtGroup);
    fn mt_dist_broadcast(g: *mut MtGroup, t: *const *const C_tensor, n: i64, root: i32) -> *mut c_char;
    fn mt_dist_broadcast_each(g: *mut MtGroup, t: *const *const C_tensor, roots: *const i64, n: i64) -> *mut c_char;
    fn mt_dist_send(g: *mut MtGroup, t: *const C_tensor, dst: i32, tag: i32) -> *mut c_char;
    fn mt_dist_recv(g: *mut MtGroup, t: *const C_tensor, src: i32, tag: i32) -> *mut c_char;
    fn mt_dist_allreduce_sum(g: *mut MtGroup, t: *const C_tensor) -> *mut c_char;
    fn mt_dist_allgather(g: *mut MtGroup, input: *const C_tensor, out: *const *const C_tensor, n: i64) -> *mut c_char;
    fn mt_dist_barrier(g: *mut MtGroup) -> *mut c_char;
    fn mt_dist_store_set(g: *mut MtGroup, key: *const c_char, value: *const c_char) -> *mut c_char;
    fn mt_dist_store_get(g: *mut MtGroup, key: *const c_char, buf: *mut c_char, cap: i64, len: *mut i64)
        -> *mut c_char;
    fn mt_reducer_new(
        g: *mut MtGroup,
        params: *const *const C_tensor,
        n: i64,
        first_cap: i64,
        cap: i64,
        out: *mut *mut MtReducer,
    ) -> *mut c_char;
    fn mt_reducer_free(r: *mut MtReducer);
    fn mt_reducer_enter(r: *mut MtReducer) -> *mut c_char;
    fn mt_reducer_arm(r: *mut MtReducer) -> *mut c_char;
    fn mt_reducer_settle(r: *mut MtReducer, failed: i32) -> *mut c_char;
}

/// Which c10d backends this build carries.
#[derive(Debug, Clone, Copy)]
pub struct Backends {
    pub gloo: bool,
    pub nccl: bool,
}

pub fn backends() -> Backends {
    #[cfg(memtrain_dist)]
    {
        let b = unsafe { mt_dist_backends() };
        Backends {
            gloo: b & 1 != 0,
            nccl: b & 2 != 0,
        }
    }
    #[cfg(not(memtrain_dist))]
    Backends {
        gloo: false,
        nccl: false,
    }
}

/// Where and how to join: the rendezvous address, this process's rank, the world size.
#[derive(Debug, Clone)]
pub struct Join<'a> {
    pub host: &'a str,
    pub port: u16,
    pub rank: usize,
    pub size: usize,
    /// Rank 0 hosts the store, unless a launcher (torchrun's agent) already does.
    pub host_store: bool,
    pub prefix: &'a str,
    /// NCCL on this CUDA device; Gloo when None.
    pub cuda_device: Option<usize>,
    /// Gloo only: where its connections to the other ranks go.
    pub gloo: &'a GlooDevice,
    pub timeout_ms: i64,
}

/// The network device Gloo's connections use.
#[derive(Debug, Clone, PartialEq)]
pub enum GlooDevice {
    /// Interfaces by name (GLOO_SOCKET_IFNAME), each checked to exist.
    Interfaces(Vec<String>),
    /// The local address that reaches the rendezvous host.
    Address(std::net::IpAddr),
}

/// A c10d process group (ProcessGroupGloo or ProcessGroupNCCL behind a ProcessGroup).
#[derive(Debug)]
pub struct Group {
    #[cfg(memtrain_dist)]
    ptr: *mut MtGroup,
}

// SAFETY: the group is used from the training thread only; c10d's own threads are internal.
unsafe impl Send for Group {}

#[cfg(memtrain_dist)]
impl Drop for Group {
    fn drop(&mut self) {
        unsafe { mt_dist_group_free(self.ptr) }
    }
}

#[cfg(memtrain_dist)]
fn ptrs<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> Vec<*const C_tensor> {
    ts.into_iter().map(|t| t.as_ptr()).collect()
}

#[cfg(memtrain_dist)]
impl Group {
    pub fn join(j: &Join) -> Result<Group> {
        let host = CString::new(j.host)?;
        let prefix = CString::new(j.prefix)?;
        let (ifaces, gloo_host) = match j.gloo {
            GlooDevice::Interfaces(names) => (names.join(","), String::new()),
            GlooDevice::Address(ip) => (String::new(), ip.to_string()),
        };
        let (ifaces, gloo_host) = (CString::new(ifaces)?, CString::new(gloo_host)?);
        let mut ptr = std::ptr::null_mut();
        check(unsafe {
            mt_dist_group_new(
                host.as_ptr(),
                j.port as i32,
                j.rank as i32,
                j.size as i32,
                (j.host_store && j.rank == 0) as i32,
                prefix.as_ptr(),
                j.cuda_device.is_some() as i32,
                j.cuda_device.unwrap_or(0) as i64,
                ifaces.as_ptr(),
                gloo_host.as_ptr(),
                j.timeout_ms,
                &mut ptr,
            )
        })?;
        Ok(Group { ptr })
    }

    pub fn broadcast(&self, tensors: &[&Tensor], root: usize) -> Result<()> {
        let p = ptrs(tensors.iter().copied());
        check(unsafe { mt_dist_broadcast(self.ptr, p.as_ptr(), p.len() as i64, root as i32) })
    }

    /// Tensor i takes rank `roots[i]`'s values, in place.
    pub fn broadcast_each(&self, tensors: &[&Tensor], roots: &[usize]) -> Result<()> {
        assert_eq!(tensors.len(), roots.len());
        let p = ptrs(tensors.iter().copied());
        let r: Vec<i64> = roots.iter().map(|&r| r as i64).collect();
        check(unsafe { mt_dist_broadcast_each(self.ptr, p.as_ptr(), r.as_ptr(), p.len() as i64) })
    }

    pub fn send(&self, t: &Tensor, dst: usize, tag: i32) -> Result<()> {
        check(unsafe { mt_dist_send(self.ptr, t.as_ptr(), dst as i32, tag) })
    }

    pub fn recv(&self, t: &Tensor, src: usize, tag: i32) -> Result<()> {
        check(unsafe { mt_dist_recv(self.ptr, t.as_ptr(), src as i32, tag) })
    }

    pub fn allreduce_sum(&self, t: &Tensor) -> Result<()> {
        check(unsafe { mt_dist_allreduce_sum(self.ptr, t.as_ptr()) })
    }

    pub fn allgather(&self, input: &Tensor, out: &[Tensor]) -> Result<()> {
        let p = ptrs(out);
        check(unsafe { mt_dist_allgather(self.ptr, input.as_ptr(), p.as_ptr(), p.len() as i64) })
    }

    pub fn barrier(&self) -> Result<()> {
        check(unsafe { mt_dist_barrier(self.ptr) })
    }

    pub fn store_set(&self, key: &str, value: &str) -> Result<()> {
        let (k, v) = (CString::new(key)?, CString::new(value)?);
        check(unsafe { mt_dist_store_set(self.ptr, k.as_ptr(), v.as_ptr()) })
    }

    pub fn store_get(&self, key: &str) -> Result<String> {
        let k = CString::new(key)?;
        let mut buf = vec![0u8; 256];
        let mut len = 0i64;
        check(unsafe {
            mt_dist_store_get(
                self.ptr,
                k.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len() as i64,
                &mut len,
            )
        })?;
        buf.truncate((len as usize).min(buf.len()));
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

#[cfg(not(memtrain_dist))]
impl Group {
    pub fn join(_: &Join) -> Result<Group> {
        anyhow::bail!(
            "this memtrain was built without Gloo's or NCCL's headers, so it cannot train data-parallel; \
             install them (Debian/Ubuntu: apt-get install libgloo-dev) and rebuild (scripts/bootstrap does both)"
        )
    }
    pub fn broadcast(&self, _: &[&Tensor], _: usize) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn broadcast_each(&self, _: &[&Tensor], _: &[usize]) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn send(&self, _: &Tensor, _: usize, _: i32) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn recv(&self, _: &Tensor, _: usize, _: i32) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn allreduce_sum(&self, _: &Tensor) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn allgather(&self, _: &Tensor, _: &[Tensor]) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn barrier(&self) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn store_set(&self, _: &str, _: &str) -> Result<()> {
        unreachable!("no group without distributed support")
    }
    pub fn store_get(&self, _: &str) -> Result<String> {
        unreachable!("no group without distributed support")
    }
}

/// DDP's Reducer: gradient buckets summed across ranks from autograd hooks during backward.
#[derive(Debug)]
pub struct Reducer {
    #[cfg(memtrain_dist)]
    ptr: *mut MtReducer,
}

unsafe impl Send for Reducer {}

#[cfg(memtrain_dist)]
impl Drop for Reducer {
    fn drop(&mut self) {
        unsafe { mt_reducer_free(self.ptr) }
    }
}

/// DDP's bucket sizes: 1 MiB for the first bucket, 25 MiB for the others.
pub const FIRST_BUCKET_BYTES: i64 = 1 << 20;
pub const BUCKET_BYTES: i64 = 25 << 20;

#[cfg(memtrain_dist)]
impl Reducer {
    pub fn new(group: &Group, params: &[&Tensor]) -> Result<Reducer> {
        let p = ptrs(params.iter().copied());
        let mut ptr = std::ptr::null_mut();
        check(unsafe {
            mt_reducer_new(
                group.ptr,
                p.as_ptr(),
                p.len() as i64,
                FIRST_BUCKET_BYTES,
                BUCKET_BYTES,
                &mut ptr,
            )
        })?;
        Ok(Reducer { ptr })
    }
    /// Before anything of a weight step can fail, on every rank.
    pub fn enter(&self) -> Result<()> {
        check(unsafe { mt_reducer_enter(self.ptr) })
    }
    /// The next backward pass synchronises.
    pub fn arm(&self) -> Result<()> {
        check(unsafe { mt_reducer_arm(self.ptr) })
    }
    /// After the step's backward work; `failed`: launch zeros for what this rank did not.
    pub fn settle(&self, failed: bool) -> Result<()> {
        check(unsafe { mt_reducer_settle(self.ptr, failed as i32) })
    }
}

#[cfg(not(memtrain_dist))]
impl Reducer {
    pub fn new(_: &Group, _: &[&Tensor]) -> Result<Reducer> {
        unreachable!("no group without distributed support")
    }
    pub fn enter(&self) -> Result<()> {
        unreachable!()
    }
    pub fn arm(&self) -> Result<()> {
        unreachable!()
    }
    pub fn settle(&self, _: bool) -> Result<()> {
        unreachable!()
    }
}
