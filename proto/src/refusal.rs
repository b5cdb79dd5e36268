//! Typed reasons on worker error statuses (`tandem.v1.Refusal`, carried as the gRPC richer error model
//! does: a `google.rpc.Status` in the status details whose one detail is the refusal as an `Any`). A worker
//! without room answers [`no_room`]; the router asks [`reason`] instead of reading the message, because the
//! HTTP/2 layer raises the same RESOURCE_EXHAUSTED code for a failing connection.

use prost::Message;

use crate::v1::{Refusal, RefusalReason};

const REFUSAL_TYPE_URL: &str = "type.googleapis.com/tandem.v1.Refusal";

/// `google.rpc.Status` (googleapis `google/rpc/status.proto`), the container of the status details.
#[derive(Clone, PartialEq, Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// RESOURCE_EXHAUSTED with the [`RefusalReason::NoRoom`] detail: this worker has no room for the request now.
pub fn no_room(message: impl Into<String>) -> tonic::Status {
    refused(tonic::Code::ResourceExhausted, message.into(), RefusalReason::NoRoom)
}

fn refused(code: tonic::Code, message: String, reason: RefusalReason) -> tonic::Status {
    let refusal = Refusal { reason: reason as i32 };
    let details = RpcStatus {
        code: code as i32,
        message: message.clone(),
        details: vec![Any { type_url: REFUSAL_TYPE_URL.into(), value: refusal.encode_to_vec() }],
    };
    tonic::Status::with_details(code, message, details.encode_to_vec().into())
}

/// The refusal reason a status carries; None for statuses without one (other errors, and those raised
/// by the transport rather than by a worker).
pub fn reason(status: &tonic::Status) -> Option<RefusalReason> {
    let details = RpcStatus::decode(status.details()).ok()?;
    let any = details.details.iter().find(|a| a.type_url == REFUSAL_TYPE_URL)?;
    let refusal = Refusal::decode(any.value.as_slice()).ok()?;
    RefusalReason::try_from(refusal.reason).ok().filter(|r| *r != RefusalReason::Unspecified)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_room_survives_the_trailer_and_other_statuses_carry_no_reason() {
        let s = no_room("no free KV blocks");
        assert_eq!((s.code(), s.message()), (tonic::Code::ResourceExhausted, "no free KV blocks"));
        // What the client decodes from the trailers.
        let mut trailers = tonic::metadata::MetadataMap::new().into_headers();
        s.add_header(&mut trailers).unwrap();
        let received = tonic::Status::from_header_map(&trailers).unwrap();
        assert_eq!(reason(&received), Some(RefusalReason::NoRoom));
        assert_eq!(reason(&tonic::Status::resource_exhausted("h2 protocol error: ENHANCE_YOUR_CALM")), None);
        let garbage = tonic::Status::with_details(tonic::Code::ResourceExhausted, "x", vec![0xff, 0x01].into());
        assert_eq!(reason(&garbage), None);
    }
}
