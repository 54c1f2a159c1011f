//! Errors of data-parallel training.

use dfdx::tensor::CpuError;

/// What can go wrong when ranks train together. Each variant is raised on **every** rank at the
/// same point (the ranks agree on it through a collective), so no rank is left waiting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// The ranks' master models differ in layout (number of trainable tensors or their sizes).
    #[error(
        "the ranks' master models differ: this rank (rank {rank}) has {tensors} trainable tensors \
         with {elements} elements in all, and at least one other rank has a different layout; \
         every rank must build the same model"
    )]
    LayoutMismatch {
        /// This rank.
        rank: usize,
        /// Trainable tensors on this rank.
        tensors: usize,
        /// Their elements.
        elements: usize,
    },

    /// The ranks disagree on the settings of the reduction, on the loss scale or on the
    /// scaler's counters (a rank restored from another checkpoint than the others).
    #[error(
        "the ranks disagree on the data-parallel settings: this rank (rank {rank}) reduces in \
         {dtype} with {accumulation} backward pass(es) per update at loss scale {scale}, after \
         {applied} applied and {skipped} skipped updates, and at least one other rank does not; \
         build every rank's `Reducer` and `GradScaler` the same way, and restore every rank from \
         the same checkpoint"
    )]
    ConfigMismatch {
        /// This rank.
        rank: usize,
        /// This rank's wire type.
        dtype: &'static str,
        /// This rank's accumulation count.
        accumulation: u32,
        /// This rank's loss scale.
        scale: f32,
        /// This rank's applied updates.
        applied: u64,
        /// This rank's skipped updates.
        skipped: u64,
    },

    /// The update came before the last micro-batch's backward pass (or after too many).
    #[error(
        "the reducer expects {expected} backward pass(es) per update (`Reducer::with_accumulation`), \
         but {found} ran since the last update; the gradients are all-reduced in the backward pass \
         of the last micro-batch, so every update must follow exactly {expected}"
    )]
    AccumulationMismatch {
        /// The accumulation count set on the reducer.
        expected: u32,
        /// Backward passes seen since the last update.
        found: u32,
    },

    /// A loss scale for the half wire that is not finite and positive.
    #[error("the loss scale for the all-reduce must be finite and greater than 0, got {scale}")]
    InvalidScale {
        /// The offending scale.
        scale: f32,
    },

    /// The update came after a backward pass whose all-reduce failed (its error was returned
    /// there): the gradients were not averaged, so no rank applies them.
    #[error(
        "the last backward pass's all-reduce failed (see its error), so its gradients are this \
         rank's alone; the update is refused on every rank. Fix the cause and start the step again"
    )]
    ReductionFailed,

    /// The reducer was used from another thread than the one that made it, and MPI was not
    /// initialised for calls from any thread (`Threading::Multiple`). Raised on this rank only,
    /// before any message is sent.
    #[error(
        "this reducer was made on another thread, and MPI was initialised with threading level {level:?}, which allows MPI calls from that thread alone; use the reducer (and the scaler that holds it) on the thread that made it, or initialise MPI with `mpi::initialize_with_threading(mpi::Threading::Multiple)`"
    )]
    WrongThread {
        /// The threading level MPI runs at.
        level: mpi::Threading,
    },

    /// An accumulation count of zero.
    #[error("the accumulation count must be at least 1, got 0")]
    ZeroAccumulation,

    /// The backward pass did not go through the scaler's forward pass, so the gradients to
    /// reduce are not known.
    #[error(
        "the gradients to all-reduce are unknown: run the forward pass through the `GradScaler` \
         (`scaler.forward` or `#[mixed_step]`) before its backward pass"
    )]
    NoForward,

    /// A root rank that is not in the communicator.
    #[error("rank {root} is not in the communicator (size {size})")]
    NoSuchRank {
        /// The rank asked for.
        root: usize,
        /// The communicator's size.
        size: usize,
    },

    /// The device failed (allocating a gradient entry).
    #[error("the device failed during the data-parallel reduction")]
    Device(#[from] CpuError),
}
