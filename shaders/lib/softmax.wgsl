// Online softmax helpers shared by the attention kernels.
//
// Scores that are masked out are stored as MASKED, a finite stand-in for -inf: WGSL has no
// infinity literal, and keeping the sentinel finite means exp(MASKED - MASKED) is 1, never NaN.

const MASKED: f32 = -3.0e38;
// Any score below this is a masked one.
const MASKED_BELOW: f32 = -1.0e38;

// exp(s - m) for a score s that may be masked.
fn softmax_weight(s: f32, m: f32) -> f32 {
    return select(0.0, exp(s - m), s > MASKED_BELOW);
}

// The score transformations of DESIGN.md section 2 after the dot product, in order:
// scale, logit softcap (cap > 0), ALiBi bias (slope * distance).
fn score_transform(dot_qk: f32, scale: f32, softcap: f32, alibi: f32) -> f32 {
    var s = scale * dot_qk;
    if softcap > 0.0 {
        s = softcap * tanh(s / softcap);
    }
    return s - alibi;
}

// Log-sum-exp of a row from its running max and sum; -inf when nothing was visible.
fn softmax_lse(m: f32, l: f32) -> f32 {
    return select(bitcast<f32>(0xff800000u), m + log(l), l > 0.0);
}

// Folds a sink logit into a finished row state (m, l): returns (m', l', factor) where factor
// rescales the row's unnormalized output.
fn softmax_add_sink(m: f32, l: f32, sink: f32) -> vec3<f32> {
    let m2 = max(m, sink);
    let a = exp(m - m2);
    return vec3<f32>(m2, l * a + exp(sink - m2), a);
}
