//! Cluster membership shared by the router and both workers: the discovery trait (etcd, static), worker registration, drain and load reporting.
