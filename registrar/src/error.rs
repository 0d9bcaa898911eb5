use thiserror::Error;

#[derive(Debug, Error)]
pub enum RegisterError {
    /// The input itself is wrong; retrying cannot help.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Name(#[from] toolgate_model::NameError),
    #[error(transparent)]
    Endpoint(#[from] toolgate_model::EndpointError),
    #[error(transparent)]
    Metadata(#[from] toolgate_model::InstanceError),
    #[error("etcd at {endpoints} did not answer within {waited_ms} ms: {last_error}")]
    Unreachable {
        endpoints: String,
        waited_ms: u128,
        last_error: String,
    },
    #[error("etcd granted a lease of {granted} s for a requested TTL of {requested} s: the server's minimum TTL is higher; use --ttl {granted} or more")]
    TtlBelowServerMinimum { requested: i64, granted: i64 },
    /// etcd authenticated (or tried to) and said no: a wrong password, or a role that does not
    /// allow this key. Final: retrying cannot change it.
    #[error("etcd refused {what}: {detail}")]
    Refused { what: String, detail: String },
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
}

impl RegisterError {
    /// Errors caused by the caller's input (exit code 2 in the CLI) rather than by the world.
    pub fn is_usage(&self) -> bool {
        !matches!(self, RegisterError::Etcd(_))
    }
}
