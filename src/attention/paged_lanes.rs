//! The source of the lanes attention kernel (`shaders/paged_lanes.wgsl`): the WGSL file with
//! its `@unroll` sections written out for one [`LanesShape`] (rows per tile, columns of the
//! query, RoPE and output rows, how the K and V formats pack columns into words). Each query
//! and accumulator value gets a name of its own, so a CPU-backed adapter keeps it in a register
//! rather than in an indexed array (which it would access lane by lane), and the module holds
//! only the code that shape runs. The host side of the kernel is [`super::paged`], which plans
//! and dispatches it.

use std::fmt::Write;

use crate::quant::KvDtype;

/// Rows per tile the kernel is written out for at most.
pub const L_MAX_TILE: usize = 8;
/// Largest query row (K dims plus RoPE dims) and output row.
pub const L_MAX_DIM: usize = 256;
/// Largest RoPE part of an MLA key.
pub const L_MAX_ROPE: usize = 64;

const TEMPLATE: &str = include_str!("../../shaders/paged_lanes.wgsl");

/// What the lanes kernel's code is written out for. Part of its
/// [`ShaderVariant`](crate::shader::ShaderVariant): each shape is its own module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LanesShape {
    /// Rows per tile (the `TILE` override must be the same).
    pub tile: u16,
    /// vec4 columns of a key's K-pool part (`K_DIM / 4`).
    pub k_cols: u16,
    /// vec4 columns of an MLA key's RoPE part (`ROPE_DIM / 4`; 0 otherwise).
    pub rope_cols: u16,
    /// vec4 columns of an output row (`OUT_DIM / 4`).
    pub out_cols: u16,
    /// vec4 columns per four words of the K pool's format (1, 2, 4 or 8 for int4).
    pub k_qpw: u8,
    /// The same for the pool the values come from.
    pub v_qpw: u8,
    /// Rows are read four words at a time (every row starts on a 16-byte boundary).
    pub wide: bool,
    /// f16 values are converted with `unpack2x16float` (the adapter has
    /// [`wgpu::DownlevelFlags::SHADER_F16_IN_F32`]) rather than by integer operations.
    pub f16_convert: bool,
    /// Pool buffers (K and V each) a dispatch binds, at least 1
    /// ([`pool_bindings`](crate::shader::pool_bindings) writes their declarations).
    pub pool_slots: u8,
}

/// vec4 columns per four words of `dtype`.
pub fn columns_per_word4(dtype: KvDtype) -> u8 {
    match dtype {
        KvDtype::F32 => 1,
        KvDtype::F16 | KvDtype::Bf16 => 2,
        KvDtype::Int4 => 8,
        _ => 4,
    }
}

impl LanesShape {
    /// `t4 k32 r0 o32 w2/2 wide cvt p3` (for shader names; `p3`: three pool slots).
    pub fn name(&self) -> String {
        format!(
            "t{} k{} r{} o{} w{}/{}{}{}{}",
            self.tile,
            self.k_cols,
            self.rope_cols,
            self.out_cols,
            self.k_qpw,
            self.v_qpw,
            if self.wide { " wide" } else { "" },
            if self.f16_convert { " cvt" } else { "" },
            match self.pool_slots {
                0 | 1 => String::new(),
                n => format!(" p{n}"),
            }
        )
    }

    /// The kernel body with every `@unroll` section written out for this shape.
    pub fn body(&self) -> String {
        let mut out = String::with_capacity(64 << 10);
        for line in TEMPLATE.lines() {
            out.push_str(line);
            out.push('\n');
            if let Some(rest) = line.trim_start().strip_prefix("// @unroll ") {
                self.section(&mut out, rest.split(':').next().unwrap_or(""));
            }
        }
        out
    }

    // Writing to a String cannot fail: the `let _ = writeln!` below ignore an Ok.
    fn section(&self, w: &mut String, name: &str) {
        let rows = 0..usize::from(self.tile);
        let (k_cols, rope, out_cols) = (
            usize::from(self.k_cols),
            usize::from(self.rope_cols),
            usize::from(self.out_cols),
        );
        match name {
            "half2" => {
                let body = if self.f16_convert {
                    "unpack2x16float(w)"
                } else {
                    "kv_unpack_f16x2(w)"
                };
                let _ = writeln!(
                    w,
                    "fn kv_half2(w: u32) -> vec2<f32> {{\n    return {body};\n}}"
                );
            }
            "declare" => {
                for t in rows {
                    let _ = writeln!(
                        w,
                        "    var m_{t} = MASKED;\n    var l_{t} = 0.0;\n    var pos_{t} = 0u;\n    var slope_{t} = 0.0;\n    var bad_{t} = false;"
                    );
                    for c in 0..k_cols {
                        let _ = writeln!(w, "    var q_{t}_{c} = vec4<f32>(0.0);");
                    }
                    for c in 0..rope {
                        let _ = writeln!(w, "    var qr_{t}_{c} = vec4<f32>(0.0);");
                    }
                    for c in 0..out_cols {
                        let _ = writeln!(w, "    var a_{t}_{c} = vec4<f32>(0.0);");
                    }
                }
            }
            "load_queries" => {
                for t in rows {
                    let _ = writeln!(w, "    {{");
                    let _ = writeln!(w, "        let r = it.row0 + min({t}u, it.n_rows - 1u);");
                    let _ = writeln!(w, "        let h = kv_head * GROUP + r % GROUP;");
                    let _ = writeln!(w, "        pos_{t} = r / GROUP + it.len_k - it.len_q;");
                    let _ = writeln!(
                        w,
                        "        slope_{t} = select(0.0, bitcast<f32>(plan[params.slopes_at + h]), alibi);"
                    );
                    let _ = writeln!(
                        w,
                        "        let qb = ((it.q_base + r / GROUP) * params.num_q_heads + h) * q4;"
                    );
                    for c in 0..k_cols {
                        let _ = writeln!(w, "        q_{t}_{c} = vec4<f32>(real4(q[qb + {c}u]));");
                    }
                    for c in 0..rope {
                        let _ = writeln!(
                            w,
                            "        qr_{t}_{c} = vec4<f32>(real4(q[qb + {}u]));",
                            k_cols + c
                        );
                    }
                    let _ = writeln!(w, "    }}");
                }
            }
            "key_dots" => {
                for t in rows.clone() {
                    let _ = writeln!(w, "        var d_{t} = 0.0;");
                }
                let _ = writeln!(w, "        var sm = vec2<f32>(0.0);");
                let dots = |w: &mut String, c: usize| {
                    for t in rows.clone() {
                        let _ = writeln!(w, "            d_{t} += dot(q_{t}_{c}, k);");
                    }
                };
                self.columns(w, ("kp", "K_DTYPE", self.k_qpw), k_cols, &dots);
            }
            "rope_dots" => {
                for t in rows.clone() {
                    let _ = writeln!(w, "        d_{t} *= k_scale;");
                }
                for c in 0..rope {
                    let _ = writeln!(w, "        {{");
                    let _ = writeln!(
                        w,
                        "            let k = vec4<f32>(real4(kv_load4(kp + 1u, row, {c}u)));"
                    );
                    for t in rows.clone() {
                        let _ = writeln!(w, "            d_{t} += dot(qr_{t}_{c}, k);");
                    }
                    let _ = writeln!(w, "        }}");
                }
            }
            "softmax" => {
                for t in rows {
                    let _ = writeln!(
                        w,
                        "        var alpha_{t} = 1.0;\n        var p_{t} = 0.0;\n        var live_{t} = false;"
                    );
                    let _ = writeln!(w, "        {{");
                    let _ = writeln!(w, "            var visible = true;");
                    let _ = writeln!(w, "            if causal {{");
                    let _ = writeln!(w, "                visible = j <= pos_{t};");
                    let _ = writeln!(
                        w,
                        "                if params.window > 0u {{ visible = visible && pos_{t} - j < params.window; }}"
                    );
                    let _ = writeln!(w, "            }}");
                    let _ = writeln!(
                        w,
                        "            let dist = select(j - pos_{t}, pos_{t} - j, pos_{t} >= j);"
                    );
                    let _ = writeln!(
                        w,
                        "            let sc = score_of(d_{t}, params.scale, params.softcap, slope_{t} * f32(dist));"
                    );
                    let _ = writeln!(
                        w,
                        "            bad_{t} = bad_{t} || (visible && sc.poison);"
                    );
                    let _ = writeln!(w, "            let s = select(MASKED, sc.value, visible);");
                    let _ = writeln!(w, "            let mx = max(m_{t}, s);");
                    let _ = writeln!(w, "            alpha_{t} = exp(m_{t} - mx);");
                    let _ = writeln!(w, "            let p = f32(real(softmax_weight(s, mx)));");
                    let _ = writeln!(w, "            l_{t} = l_{t} * alpha_{t} + p;");
                    let _ = writeln!(w, "            m_{t} = mx;");
                    let _ = writeln!(w, "            live_{t} = bits_nonzero(p);");
                    let _ = writeln!(w, "            p_{t} = select(0.0, p * v_scale, live_{t});");
                    let _ = writeln!(w, "        }}");
                }
            }
            "values" => {
                let _ = writeln!(w, "        sm = vec2<f32>(0.0);");
                let acc = |w: &mut String, c: usize| {
                    for t in rows.clone() {
                        let _ = writeln!(
                            w,
                            "            a_{t}_{c} = a_{t}_{c} * alpha_{t} + select(vec4<f32>(0.0), p_{t} * k, live_{t});"
                        );
                    }
                };
                self.columns(w, ("vp", "kv_dtype_of(vp)", self.v_qpw), out_cols, &acc);
            }
            "write" => {
                for t in rows {
                    let _ = writeln!(w, "    if it.n_rows > {t}u {{");
                    let _ = writeln!(
                        w,
                        "        let inv = select(0.0, 1.0 / l_{t}, l_{t} > 0.0) * v_tensor_scale;"
                    );
                    let _ = writeln!(w, "        let ob = (out_base + {t}u) * dv4;");
                    let _ = writeln!(w, "        let nan = nan_f32();");
                    for c in 0..out_cols {
                        let _ = writeln!(
                            w,
                            "        o_part[ob + {c}u] = select(a_{t}_{c} * inv, vec4<f32>(nan), bad_{t});"
                        );
                    }
                    let _ = writeln!(
                        w,
                        "        lse_part[out_base + {t}u] = select(softmax_lse(m_{t}, l_{t}), nan, bad_{t});"
                    );
                    let _ = writeln!(w, "    }}");
                }
            }
            _ => {}
        }
    }

    /// Columns `0..cols` of pool `which` (format `dtype`, `qpw` columns per four words), each
    /// decoded into `k` (codes, `real`-rounded) before `use_column(c)`: four words per access
    /// when the shape is wide, else through `kv_load4_codes` (int4 decodes each group's scale
    /// and min once either way).
    fn columns(
        &self,
        w: &mut String,
        (which, dtype, qpw): (&str, &str, u8),
        cols: usize,
        use_column: &dyn Fn(&mut String, usize),
    ) {
        let qpw = usize::from(qpw);
        let int4 = qpw == 8;
        if self.wide {
            for word in 0..cols.div_ceil(qpw) {
                let _ = writeln!(w, "        {{");
                let _ = writeln!(w, "        let wv = kv_word4({which}, row, {word}u);");
                if int4 {
                    let _ = writeln!(w, "        sm = kv_int4_group({which}, row, {word}u);");
                }
                for c in (word * qpw..(word + 1) * qpw).filter(|&c| c < cols) {
                    let _ = writeln!(w, "        {{");
                    let _ = writeln!(
                        w,
                        "            let k = vec4<f32>(real4(kv_quad_of({dtype}, wv, {}u, sm)));",
                        c - word * qpw
                    );
                    use_column(w, c);
                    let _ = writeln!(w, "        }}");
                }
                let _ = writeln!(w, "        }}");
            }
        } else {
            for c in 0..cols {
                let _ = writeln!(w, "        {{");
                if int4 {
                    if c % 8 == 0 {
                        let _ =
                            writeln!(w, "        sm = kv_int4_group({which}, row, {}u);", c / 8);
                    }
                    let _ = writeln!(
                        w,
                        "            let k = vec4<f32>(real4(kv_int4_load4({which}, row, {c}u, sm)));"
                    );
                } else {
                    let _ = writeln!(
                        w,
                        "            let k = vec4<f32>(real4(kv_load4_codes({which}, row, {c}u)));"
                    );
                }
                use_column(w, c);
                let _ = writeln!(w, "        }}");
            }
        }
    }
}
