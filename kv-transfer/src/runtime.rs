//! The small tokio runtime each receiver and sender owns for its network tasks and timers, so the crate
//! works the same under an async worker and from plain threads.

use crate::TransferError;

pub(crate) struct Runtime {
    rt: Option<tokio::runtime::Runtime>,
}

impl Runtime {
    /// `lanes`: connections one link stripes over; each gets a thread to copy on (at least 2).
    pub fn new(name: &str, lanes: Option<usize>) -> Result<std::sync::Arc<Runtime>, TransferError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(crate::transport::lanes::lanes_or_default(lanes).max(2))
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(|e| TransferError::Transport(format!("cannot start the {name} runtime: {e}")))?;
        Ok(std::sync::Arc::new(Runtime { rt: Some(rt) }))
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.as_ref().expect("runtime lives until drop").handle()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Dropping a runtime inside another runtime's task panics; shutting down in the background does not.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
