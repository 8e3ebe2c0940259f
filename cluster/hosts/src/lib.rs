//! The hosts, written once and sans-I/O: the front host ([`front_host`]), the client
//! ([`client`]) and the serving front door it plays through ([`frontend`]), a rank's host policy ([`rank_host`]: ingress into fetches, the stall
//! bound, the forward's modeled time) and a rank's transceiver host
//! ([`transceiver_host`]), over the [`Net`](net::Net) their messages go out on. Every driver runs
//! these same hosts and only moves their inputs and outputs: the simulator in one
//! thread, in virtual time, over a simulated network (TigerBeetle's way: the real
//! replica over a simulated network); the real drivers (`lockstep-runtime`) over
//! channels or MPI, in wall time, with a blocking loop around each.

#![forbid(unsafe_code)]

mod by_id;
pub mod client;
pub mod front_host;
pub mod frontend;
pub mod net;
pub mod order;
pub mod rank_host;
pub mod stall;
pub mod status;
pub mod transceiver_host;
