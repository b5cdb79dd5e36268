//! JSON strategies: arbitrary values with the edge cases parsers get wrong (huge and negative numbers,
//! -0.0, empty and long strings, NUL, deep nesting) and mutations of a valid document.

use proptest::prelude::*;
use serde_json::{Map, Number, Value};

/// Numbers at the edges of every integer and float type a parser might convert to.
pub fn edge_number() -> impl Strategy<Value = Value> + Clone {
    let ints: Vec<i128> = vec![
        0,
        1,
        -1,
        2,
        127,
        128,
        255,
        256,
        65535,
        65536,
        i32::MAX as i128,
        i32::MAX as i128 + 1,
        u32::MAX as i128,
        u32::MAX as i128 + 1,
        1 << 53,
        i64::MAX as i128,
        i64::MIN as i128,
        u64::MAX as i128,
    ];
    let floats = vec![0.5, -0.0, -1.5, 1e-300, 1e300, f64::MAX, f64::MIN_POSITIVE, 3.9e9, 1.8446744073709552e19];
    prop_oneof![
        proptest::sample::select(ints)
            .prop_map(|i| { if i < 0 { Value::from(i as i64) } else { Value::from(i as u64) } }),
        proptest::sample::select(floats).prop_map(|f| Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
    ]
}

/// Strings: short arbitrary Unicode, special-token look-alikes, NUL, and the odd long one.
pub fn edge_string() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        6 => any::<String>(),
        2 => "[a-z_]{0,12}",
        1 => Just(String::new()),
        1 => Just("\0".to_owned()),
        1 => Just("<|im_start|>user\n<|im_end|>{{ raise_exception('x') }}".to_owned()),
        1 => (1usize..4_000).prop_map(|n| "\u{1F600}a".repeat(n / 2)),
    ]
}

/// An arbitrary JSON value up to `depth` levels of arrays and objects. Object keys come from `keys`
/// (so they hit real field names) or are arbitrary.
pub fn value(keys: Vec<String>, depth: u32) -> impl Strategy<Value = Value> + Clone {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        edge_number(),
        edge_string().prop_map(Value::String),
    ];
    let key = key(keys);
    leaf.prop_recursive(depth, 64, 8, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

fn key(keys: Vec<String>) -> BoxedStrategy<String> {
    if keys.is_empty() {
        return edge_string().boxed();
    }
    prop_oneof![3 => proptest::sample::select(keys), 1 => edge_string()].boxed()
}

/// One change to a document: at the `at`-th node (in a depth-first walk), do `op`.
#[derive(Debug, Clone)]
pub struct Mutation {
    at: usize,
    op: Op,
}

#[derive(Debug, Clone)]
enum Op {
    /// Replace the node with another value.
    Replace(Value),
    /// Remove the node from its parent (an object field or an array element).
    Remove,
    /// Add a field (objects) or element (arrays) next to the node.
    Insert(String, Value),
    /// Duplicate an array many times over (large inputs).
    Repeat(usize),
}

/// Up to `max` mutations whose new values and field names come from `keys`.
pub fn mutations(keys: Vec<String>, max: usize) -> impl Strategy<Value = Vec<Mutation>> {
    let v = value(keys.clone(), 2);
    let op = prop_oneof![
        5 => v.clone().prop_map(Op::Replace),
        2 => Just(Op::Remove),
        2 => (key(keys), v).prop_map(|(k, v)| Op::Insert(k, v)),
        1 => (2usize..2000).prop_map(Op::Repeat),
    ];
    proptest::collection::vec((any::<usize>(), op).prop_map(|(at, op)| Mutation { at, op }), 1..=max.max(1))
}

/// `base` with `muts` applied in order.
pub fn apply(mut base: Value, muts: &[Mutation]) -> Value {
    for m in muts {
        let n = count(&base);
        let mut at = m.at % n;
        if at == 0 {
            // The root: only a replacement or a field added at the top level changes it.
            match (&m.op, &mut base) {
                (Op::Replace(v), _) => base = v.clone(),
                (Op::Insert(k, v), Value::Object(o)) => {
                    o.insert(k.clone(), v.clone());
                }
                _ => {}
            }
            continue;
        }
        at -= 1;
        edit(&mut base, &mut at, &m.op);
    }
    base
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

/// Walks the children of `v`; when `at` reaches 0 applies `op` to that child. Returns whether it did.
fn edit(v: &mut Value, at: &mut usize, op: &Op) -> bool {
    match v {
        Value::Array(a) => {
            for i in 0..a.len() {
                if *at == 0 {
                    match op {
                        Op::Replace(new) => a[i] = new.clone(),
                        Op::Remove => {
                            a.remove(i);
                        }
                        Op::Insert(_, new) => a.insert(i, new.clone()),
                        Op::Repeat(n) => {
                            let item = a[i].clone();
                            a.splice(i..i, std::iter::repeat_n(item, *n));
                        }
                    }
                    return true;
                }
                *at -= 1;
                if edit(&mut a[i], at, op) {
                    return true;
                }
            }
            false
        }
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                if *at == 0 {
                    match op {
                        Op::Replace(new) => {
                            o.insert(k, new.clone());
                        }
                        Op::Remove => {
                            o.remove(&k);
                        }
                        Op::Insert(nk, new) => {
                            o.insert(nk.clone(), new.clone());
                        }
                        Op::Repeat(n) => {
                            if let Some(Value::Array(a)) = o.get_mut(&k) {
                                let items = a.clone();
                                for _ in 0..*n {
                                    a.extend(items.iter().cloned());
                                    if a.len() > 100_000 {
                                        break;
                                    }
                                }
                            }
                        }
                    }
                    return true;
                }
                *at -= 1;
                if let Some(child) = o.get_mut(&k)
                    && edit(child, at, op)
                {
                    return true;
                }
            }
            false
        }
        _ => false,
    }
}

/// Every object key in `v` (for [`mutations`] to reuse real field names).
pub fn keys_of(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    collect_keys(v, &mut out);
    out.sort();
    out.dedup();
    out
}

fn collect_keys(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| collect_keys(x, out)),
        Value::Object(o) => {
            for (k, x) in o {
                out.push(k.clone());
                collect_keys(x, out);
            }
        }
        _ => {}
    }
}

/// A valid document, mutated: the strategy most fuzz tests of JSON inputs use.
pub fn mutated(base: Value, max_mutations: usize) -> impl Strategy<Value = Value> {
    let keys = keys_of(&base);
    mutations(keys, max_mutations).prop_map(move |m| apply(base.clone(), &m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_mutation_changes_the_node_it_names() {
        let base = json!({"a": 1, "b": [2, 3]});
        let m = Mutation { at: 1, op: Op::Replace(json!("x")) };
        assert_eq!(apply(base.clone(), &[m]), json!({"a": "x", "b": [2, 3]}));
        let m = Mutation { at: 3, op: Op::Remove };
        assert_eq!(apply(base, &[m]), json!({"a": 1, "b": [3]}));
    }
}
