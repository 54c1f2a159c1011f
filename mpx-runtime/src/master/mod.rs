//! The master's tensors as the step and the layers reach them: a tensor's gradient slot
//! ([`slots`]) and the link a fused layer writes its f32 gradients through ([`link`]). Below
//! `nn`, `step` and `distributed`, which all use them.

pub(crate) mod link;
pub(crate) mod slots;
