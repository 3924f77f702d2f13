// Precision prelude, portable variant: values are held in f32.
alias real = f32;
alias real4 = vec4<f32>;
