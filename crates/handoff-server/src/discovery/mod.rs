//! Discovery on etcd (issue 15): workers register under a lease, routers
//! watch the prefix. `etcd` is the client of etcd's v3 API; `registration`
//! is a worker's record and the task that keeps it alive; the router's
//! side (a live worker set) is `router::discovery`.

pub mod etcd;
pub mod registration;

pub use etcd::{Etcd, EtcdEndpoint, EtcdError, WatchEvent};
pub use registration::{Registrar, WorkerRecord};
