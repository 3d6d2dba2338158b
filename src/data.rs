//! PLACEHOLDER: being written by the data helper.
