//! `google.protobuf.Any`, which wraps every resource toolgate-xds serves and much inside them.
//! Its own module, below the builders of each kind of resource (`resources.rs`, `auth.rs`,
//! `ecds.rs`, `shard.rs`), so they need not import each other for it.

use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};

/// Wraps a message in `google.protobuf.Any` with its canonical type URL.
pub fn to_any<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}
