// Online softmax helpers shared by the attention kernels, and the rules for NaN and infinities
// (README, "NaN, infinities and extreme values").
//
// Scores that are masked out are stored as MASKED, a finite stand-in for -inf: WGSL has no
// infinity literal, and keeping the sentinel finite means exp(MASKED - MASKED) is 1, never NaN.
//
// WGSL lets a compiler assume that floats are finite, so a float compare, `max` or `select` may
// drop a NaN or an infinity. Every test for one here reads the bits (`bitcast<u32>`), and the
// softmax itself only ever sees finite scores: a score that is NaN or +inf poisons its row (the
// row's output and lse become NaN), a score of -inf becomes MASKED (weight 0).

const MASKED: f32 = -3.0e38;
// Any score below this is a masked one (a finite score below it counts as -inf).
const MASKED_BELOW: f32 = -1.0e38;
// The NaN the kernels write for a poisoned row.
const NAN_BITS: u32 = 0x7fc00000u;
const NEG_INF_BITS: u32 = 0xff800000u;

// NaN and -inf as values. A WGSL const-expression cannot hold either (`bitcast<f32>(NAN_BITS)`
// is a shader-creation error in Chrome's Tint, as the WGSL spec asks), so the bits go through a
// function-scope var: a runtime value, which may be anything.
fn nan_f32() -> f32 {
    var bits = NAN_BITS;
    return bitcast<f32>(bits);
}

fn neg_inf_f32() -> f32 {
    var bits = NEG_INF_BITS;
    return bitcast<f32>(bits);
}

// x is NaN.
fn bits_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// x is +inf or -inf.
fn bits_inf(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;
}

// x is NaN or +inf: a score that makes its row NaN.
fn bits_poison(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & 0x7fffffffu) > 0x7f800000u || b == 0x7f800000u;
}

// x is -inf.
fn bits_neg_inf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}

// x is not exactly +0 or -0 (a probability that contributes to the output).
fn bits_nonzero(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) != 0u;
}

// exp(s - m) for a score s that may be masked.
fn softmax_weight(s: f32, m: f32) -> f32 {
    return select(0.0, exp(s - m), s > MASKED_BELOW);
}

// One key's step of an online softmax whose running max is `m`: `raised` when the score `s`
// is above it (the new max is s), `alpha` the factor that rescales the running sum and output
// (exactly 1 unless raised), `p` the key's weight relative to the new max (0 for a masked
// score). One exp: exp(m - s) when raised, else exp(s - m).
struct SoftmaxStep {
    raised: bool,
    alpha: f32,
    p: f32,
}

fn softmax_step(m: f32, s: f32) -> SoftmaxStep {
    let raised = s > m;
    let e = exp(select(s - m, m - s, raised));
    let p = select(select(e, 1.0, raised), 0.0, s <= MASKED_BELOW);
    return SoftmaxStep(raised, select(1.0, e, raised), p);
}

// A key's score as the softmax reads it: `value` is finite (MASKED for a score of -inf or one
// that poisons), `poison` says the score was NaN or +inf.
struct Score {
    value: f32,
    poison: bool,
}

// The score transformations of ARCHITECTURE.md section 2 after the dot product, in order:
// scale, logit softcap (cap > 0), ALiBi bias (slope * distance), in IEEE arithmetic:
// a NaN product poisons (even where tanh would hide it), +-inf through the softcap gives +-cap,
// and the final score is classified by its bits.
fn score_of(dot_qk: f32, scale: f32, softcap: f32, alibi: f32) -> Score {
    var s = scale * dot_qk;
    var poison = bits_nan(s);
    if softcap > 0.0 {
        let u = s / softcap;
        // tanh(+-inf) = +-1; tanh of |u| >= 10 is 1 in f32, so the clamp changes nothing finite.
        var t = bitcast<f32>((bitcast<u32>(u) & 0x80000000u) | 0x3f800000u);
        if !bits_inf(u) {
            t = tanh(clamp(u, -10.0, 10.0));
        }
        s = softcap * t;
    }
    s = s - alibi;
    poison = poison || bits_poison(s);
    let masked = poison || bits_neg_inf(s);
    return Score(select(s, MASKED, masked), poison);
}

// Log-sum-exp of a row from its running max and sum; -inf when nothing was visible. log(0) is
// never formed: WGSL lets a compiler assume no intermediate is infinite, and a real driver
// (NVIDIA, 2026-12-04) turned such a select over 1 / sqrt(0) into NaN in rms_norm.
fn softmax_lse(m: f32, l: f32) -> f32 {
    return select(neg_inf_f32(), m + log(select(1.0, l, l > 0.0)), l > 0.0);
}

// 1 / l for a row's sum l > 0, else 0 (nothing visible), never forming 1 / 0.
fn softmax_inv_sum(l: f32) -> f32 {
    return select(0.0, 1.0 / select(1.0, l, l > 0.0), l > 0.0);
}

// A partial or merged state's lse as a merge weighs it: MASKED for -inf (no key) and for NaN
// (a poisoned state, which the caller reports through bits_nan), else itself.
fn state_lse(lse: f32) -> f32 {
    return select(lse, MASKED, bits_neg_inf(lse) || bits_nan(lse));
}

// Folds a sink logit into a finished row state (m, l): returns (m', l', factor) where factor
// rescales the row's unnormalized output.
fn softmax_add_sink(m: f32, l: f32, sink: f32) -> vec3<f32> {
    let m2 = max(m, sink);
    let a = exp(m - m2);
    return vec3<f32>(m2, l * a + exp(sink - m2), a);
}
