//! OpenAI logprobs formats: the legacy completions shape and the chat `content` list.

use proto::v1::GeneratedToken;
use serde_json::{Map, Value, json};
use text::Tokenizer;

fn top(t: &GeneratedToken) -> impl Iterator<Item = (u32, f32)> + '_ {
    t.logprobs.iter().flat_map(|l| l.top.iter().map(|x| (x.token_id, x.logprob)))
}

fn chosen(t: &GeneratedToken) -> f32 {
    t.logprobs.as_ref().and_then(|l| l.chosen.as_ref()).map(|c| c.logprob).unwrap_or(f32::NAN)
}

fn num(x: f32) -> Value {
    // JSON has no NaN/-inf: OpenAI reports -9999.0 for impossible tokens.
    if x.is_finite() { json!(x) } else { json!(-9999.0) }
}

/// Accumulates `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` for /v1/completions.
#[derive(Default)]
pub struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
    offset: usize,
}

impl CompletionLogprobs {
    pub fn push(&mut self, tok: &Tokenizer, tokens: &[GeneratedToken]) {
        for t in tokens {
            let text = tok.token_text(t.token_id);
            self.text_offset.push(json!(self.offset));
            self.offset += text.len();
            self.token_logprobs.push(num(chosen(t)));
            let mut m = Map::new();
            m.insert(text.clone(), num(chosen(t)));
            for (id, lp) in top(t) {
                m.entry(tok.token_text(id)).or_insert_with(|| num(lp));
            }
            self.top_logprobs.push(Value::Object(m));
            self.tokens.push(Value::String(text));
        }
    }

    /// The JSON object so far, leaving the accumulator empty (offsets keep counting).
    pub fn take(&mut self) -> Value {
        json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.token_logprobs),
            "top_logprobs": std::mem::take(&mut self.top_logprobs),
            "text_offset": std::mem::take(&mut self.text_offset),
        })
    }
}

fn entry(tok: &Tokenizer, id: u32, lp: f32) -> Value {
    json!({ "token": tok.token_text(id), "logprob": num(lp), "bytes": tok.token_bytes(id) })
}

/// Chat completions: one `{"token","logprob","bytes","top_logprobs":[...]}` per token.
pub fn chat_content(tok: &Tokenizer, tokens: &[GeneratedToken], top_n: usize) -> Vec<Value> {
    tokens
        .iter()
        .map(|t| {
            let mut e = entry(tok, t.token_id, chosen(t));
            let tops: Vec<Value> = top(t).take(top_n).map(|(id, lp)| entry(tok, id, lp)).collect();
            e["top_logprobs"] = Value::Array(tops);
            e
        })
        .collect()
}
