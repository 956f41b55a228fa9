//! Where the backend's Redis is and how it is reached: the topologies (one server, a
//! Sentinel group's master, a cluster), TLS, the command pool, and what a failed command
//! says.

pub(crate) mod cluster;
pub(crate) mod command_error;
pub(crate) mod master_lookup;
pub(crate) mod pool;
pub(crate) mod sentinel;
pub(crate) mod tls;
pub(crate) mod topology;
