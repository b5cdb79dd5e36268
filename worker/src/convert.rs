//! tandem.v1 <-> engine conversions.

use engine::sampling::{self, Sampled};
use proto::v1::{GeneratedToken, Logprobs, TokenLogprob};

/// The seed of a request that names none: derived from its id, so the prefill worker (first token) and
/// the decode worker (the rest) draw from the same stream without talking to each other.
pub fn seed_for(request_id: &str) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(request_id.as_bytes());
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Engine sampling parameters from the wire (an absent seed is derived from the request id).
pub fn sampling_params(p: &proto::v1::SamplingParams, request_id: &str) -> sampling::SamplingParams {
    sampling::SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        logit_bias: {
            let mut b: Vec<(u32, f32)> = p.logit_bias.iter().map(|(k, v)| (*k, *v)).collect();
            b.sort_by_key(|x| x.0);
            b
        },
        seed: p.seed.unwrap_or_else(|| seed_for(request_id)),
        max_tokens: p.max_tokens,
        min_tokens: p.min_tokens,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
    }
}

/// The wire form of a sampled token (logprobs only when the request asked for them).
pub fn generated_token(t: &Sampled, with_logprobs: bool) -> GeneratedToken {
    GeneratedToken {
        token_id: t.token,
        logprobs: with_logprobs.then(|| Logprobs {
            chosen: Some(TokenLogprob { token_id: t.token, logprob: t.logprob }),
            top: t.top.iter().map(|&(token_id, logprob)| TokenLogprob { token_id, logprob }).collect(),
        }),
    }
}

/// The engine form of a token received from another worker.
pub fn sampled(t: &GeneratedToken) -> Sampled {
    let lp = t.logprobs.as_ref();
    Sampled {
        token: t.token_id,
        logprob: lp.and_then(|l| l.chosen.as_ref()).map(|c| c.logprob).unwrap_or(0.0),
        top: lp.map(|l| l.top.iter().map(|x| (x.token_id, x.logprob)).collect()).unwrap_or_default(),
    }
}

pub fn finish_reason(f: sampling::Finish) -> proto::v1::FinishReason {
    match f {
        sampling::Finish::Stop => proto::v1::FinishReason::Stop,
        sampling::Finish::Length => proto::v1::FinishReason::Length,
    }
}
