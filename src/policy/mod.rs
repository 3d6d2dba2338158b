//! Memory policy: the levers (each term of the memory bill a run can trade for time, one file
//! per lever behind one trait) and `recovery`, the pure state machine that alone decides which
//! levers are engaged and the batch shape in force. No tensors here: the run carries out what
//! the policy decides (`levers::Target`), and `check`, `fit` and `report` read the same levers
//! to describe them.
pub mod levers;
pub mod recovery;
