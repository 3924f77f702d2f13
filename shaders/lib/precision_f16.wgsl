enable f16;
// Precision prelude, f16 variant: Q, K, V and probabilities are held in f16; products and sums
// are formed in f32 (a product of two f16 values is exact in f32).
alias real = f16;
alias real4 = vec4<f16>;
