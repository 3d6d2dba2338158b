//! CUDA graphs of a whole step (src/shim/graph.cpp): a side stream to capture on, a capture
//! into a private pool, replay. A capture that fails part-way is abandoned when its guard
//! drops, so no stream is left capturing and no pool left taking allocations.
use std::ffi::c_char;

use anyhow::Result;

use super::check;

#[repr(C)]
struct MtSideStream {
    _opaque: [u8; 0],
}

#[repr(C)]
struct MtGraph {
    _opaque: [u8; 0],
}

extern "C" {
    fn mt_side_stream_new(device: i64, out: *mut *mut MtSideStream) -> *mut c_char;
    fn mt_side_stream_enter(s: *mut MtSideStream) -> *mut c_char;
    fn mt_side_stream_leave(s: *mut MtSideStream) -> *mut c_char;
    fn mt_side_stream_free(s: *mut MtSideStream);
    fn mt_graph_begin(out: *mut *mut MtGraph) -> *mut c_char;
    fn mt_graph_end(g: *mut MtGraph) -> *mut c_char;
    fn mt_graph_abandon(g: *mut MtGraph) -> *mut c_char;
    fn mt_graph_replay(g: *mut MtGraph) -> *mut c_char;
    fn mt_graph_free(g: *mut MtGraph);
}

/// A stream of a CUDA device's own, to capture on and to warm up on.
pub struct SideStream {
    ptr: *mut MtSideStream,
}

impl SideStream {
    pub fn new(device: usize) -> Result<SideStream> {
        let mut ptr = std::ptr::null_mut();
        check(unsafe { mt_side_stream_new(device as i64, &mut ptr) })?;
        Ok(SideStream { ptr })
    }

    /// The side stream is the current stream until the scope drops; it starts after the work
    /// queued so far, and the stream that was current waits for its work when it ends.
    pub fn enter(&mut self) -> Result<OnSide<'_>> {
        check(unsafe { mt_side_stream_enter(self.ptr) })?;
        Ok(OnSide { stream: self })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        unsafe { mt_side_stream_free(self.ptr) }
    }
}

/// The side stream is current (see [`SideStream::enter`]).
pub struct OnSide<'a> {
    stream: &'a mut SideStream,
}

impl Drop for OnSide<'_> {
    fn drop(&mut self) {
        if let Err(e) = check(unsafe { mt_side_stream_leave(self.stream.ptr) }) {
            // Only a broken CUDA context fails to record an event; what follows fails louder.
            tracing::error!("leaving the capture stream: {e:#}");
        }
    }
}

/// A captured step, ready to replay; or, while [`Capture`] holds it, one being captured.
pub struct CudaGraph {
    ptr: *mut MtGraph,
}

impl CudaGraph {
    /// One launch of the whole captured work on the current stream. It allocates nothing:
    /// every tensor it reads or writes was placed at capture.
    pub fn replay(&self) -> Result<()> {
        check(unsafe { mt_graph_replay(self.ptr) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        unsafe { mt_graph_free(self.ptr) }
    }
}

/// A capture under way on the current stream (which must not be the default stream: enter a
/// [`SideStream`] first). [`Capture::end`] gives the graph; dropping it instead abandons the
/// capture.
pub struct Capture {
    graph: Option<CudaGraph>,
}

impl Capture {
    pub fn begin() -> Result<Capture> {
        let mut ptr = std::ptr::null_mut();
        check(unsafe { mt_graph_begin(&mut ptr) })?;
        Ok(Capture {
            graph: Some(CudaGraph { ptr }),
        })
    }

    pub fn end(mut self) -> Result<CudaGraph> {
        let graph = self.graph.take().expect("a capture ends once");
        match check(unsafe { mt_graph_end(graph.ptr) }) {
            Ok(()) => Ok(graph),
            Err(e) => {
                abandon(&graph);
                Err(e)
            }
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if let Some(g) = self.graph.take() {
            abandon(&g);
        }
    }
}

fn abandon(g: &CudaGraph) {
    if let Err(e) = check(unsafe { mt_graph_abandon(g.ptr) }) {
        tracing::error!("abandoning a failed capture: {e:#}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_need_a_cuda_device() {
        if tch::Cuda::is_available() {
            return;
        }
        // Without a CUDA device (or without the runtime's headers) each entry fails with a
        // message instead of crashing.
        assert!(SideStream::new(0).is_err());
    }
}
