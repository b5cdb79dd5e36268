//! When a layer's cache writes are done. A backend hands a [`LayerReady`] over with each finished layer;
//! whoever reads that layer's bytes from another thread (kv-transfer) waits on it first, so the compute
//! thread never blocks per layer and no byte is read before it is written.

use std::sync::Arc;

/// A point in a backend's work: reached once the work issued before it (a layer's cache writes) is done.
/// A GPU backend records an event on its stream; the CPU writes synchronously.
pub trait Fence: Send + Sync {
    /// Blocks until the work is done; an error when the device failed it.
    fn wait(&self) -> Result<(), String>;
    fn is_complete(&self) -> bool;
}

/// The device failed the work a marker waited for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device: {0}")]
pub struct FenceError(pub String);

/// The completion marker of one layer's cache writes.
#[derive(Clone)]
pub struct LayerReady(Option<Arc<dyn Fence>>);

impl LayerReady {
    /// The writes are already done (the CPU backend, whose writes are synchronous).
    pub fn complete() -> Self {
        LayerReady(None)
    }

    /// Done when `fence` is.
    pub fn pending(fence: Arc<dyn Fence>) -> Self {
        LayerReady(Some(fence))
    }

    pub fn is_complete(&self) -> bool {
        self.0.as_ref().is_none_or(|f| f.is_complete())
    }

    /// Blocks until the layer's bytes are written.
    pub fn wait(&self) -> Result<(), FenceError> {
        match &self.0 {
            None => Ok(()),
            Some(f) => f.wait().map_err(FenceError),
        }
    }
}

impl std::fmt::Debug for LayerReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LayerReady").field(&self.is_complete()).finish()
    }
}
