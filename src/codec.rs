//! The gRPC codec: prost, but decoding each message from one contiguous
//! slice.
//!
//! Why: a Score with 32K token ids is ~100 KB of varints. prost reading
//! them through tonic's `DecodeBuf` (a view of a `BytesMut`) pays the
//! `BytesMut` bookkeeping on every advance, once per varint: about 40% of the
//! service's CPU per such request. Taking the message as one `Bytes` (no
//! copy: the buffer is split off) and decoding from a plain slice turns that
//! into a tight loop. Encoding is prost's own.

use std::marker::PhantomData;

use bytes::Buf;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

#[derive(Debug, Clone)]
pub struct SliceCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SliceCodec<T, U> {
    fn default() -> Self {
        SliceCodec(PhantomData)
    }
}

impl<T, U> Codec for SliceCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = SliceDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        SliceDecoder(PhantomData)
    }
}

#[derive(Debug, Clone)]
pub struct SliceDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for SliceDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let message = buf.copy_to_bytes(buf.remaining());
        // As tonic's prost codec: a message that does not parse is INTERNAL.
        U::decode(&message[..])
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}
