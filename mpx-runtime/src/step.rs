//! The mixed-precision step: mixed gradients (`filter_value_and_grad`) and skip-on-overflow updates.
