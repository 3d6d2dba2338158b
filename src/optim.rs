//! PLACEHOLDER: being written by the optimizer helper.
