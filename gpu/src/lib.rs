//! Model backends for lockstep. The analytic cost model arrives with the simulator; this
//! crate is a placeholder until then.

#![forbid(unsafe_code)]
