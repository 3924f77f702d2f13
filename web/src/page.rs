//! The page: WebGPU check, adapter report, the verification table as it fills, the decoder step.

use std::cell::RefCell;
use std::rc::Rc;

use kvattn::gpu::{Context, ContextOptions};
use kvattn::verify::{self, Progress};
use wasm_bindgen::JsValue;

use crate::{now_ms, CaseRow, DecodeStep, PageResult, Selection};

fn set_global(key: &str, value: &JsValue) {
    if let Some(window) = web_sys::window() {
        let _ = js_sys::Reflect::set(&window, &JsValue::from_str(key), value);
    }
}

/// Leaves the result where scripts read it; `done` marks it final.
fn publish(result: &PageResult, done: bool) {
    let json = serde_json::to_string(result)
        .unwrap_or_else(|e| format!("{{\"error\":\"serializing the result: {e}\"}}"));
    set_global("kvattnResult", &JsValue::from_str(&json));
    set_global(
        "kvattnProgress",
        &JsValue::from_f64(result.cases.len() as f64),
    );
    if done {
        set_global("kvattnDone", &JsValue::TRUE);
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Sets the inner HTML of the element with `id` (absent elements are ignored: the page is
/// still judged by its result).
fn set_html(id: &str, html: &str) {
    if let Some(el) = web_sys::window()
        .and_then(|w| w.document())
        .and_then(|d| d.get_element_by_id(id))
    {
        el.set_inner_html(html);
    }
}

fn append_html(id: &str, html: &str) {
    if let Some(el) = web_sys::window()
        .and_then(|w| w.document())
        .and_then(|d| d.get_element_by_id(id))
    {
        let _ = el.insert_adjacent_html("beforeend", html);
    }
}

fn status(text: &str, class: &str) {
    set_html(
        "status",
        &format!("<span class=\"{class}\">{}</span>", escape(text)),
    );
}

/// A panic (a bug: every expected failure is an error) still ends the page with a result.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let message = format!("kvattn panicked: {info}");
        web_sys::console::error_1(&JsValue::from_str(&message));
        status(&message, "fail");
        let result = PageResult {
            webgpu: has_webgpu(),
            error: Some(message),
            ..Default::default()
        };
        publish(&result, true);
    }));
}

fn has_webgpu() -> bool {
    web_sys::window()
        .map(|w| w.navigator())
        .and_then(|n| js_sys::Reflect::get(&n, &JsValue::from_str("gpu")).ok())
        .is_some_and(|gpu| !gpu.is_undefined() && !gpu.is_null())
}

/// Every feature the browser's adapter offers (kebab-case names), or an error message.
async fn adapter_features() -> Result<Vec<String>, String> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::BROWSER_WEBGPU,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = instance
        .request_adapter(&wgpu::RequestAdapterOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(adapter
        .features()
        .iter()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect())
}

fn limits(ctx: &Context) -> Vec<(String, u64)> {
    let c = ctx.caps();
    [
        (
            "max_storage_buffer_binding_size",
            c.max_storage_buffer_binding_size,
        ),
        ("max_buffer_size", c.max_buffer_size),
        (
            "max_storage_buffers_per_shader_stage",
            u64::from(c.max_storage_buffers_per_shader_stage),
        ),
        (
            "max_compute_workgroup_storage_size",
            u64::from(c.max_compute_workgroup_storage_size),
        ),
        (
            "max_compute_invocations_per_workgroup",
            u64::from(c.max_compute_invocations_per_workgroup),
        ),
        (
            "max_compute_workgroups_per_dimension",
            u64::from(c.max_compute_workgroups_per_dimension),
        ),
        ("subgroup_min_size", u64::from(c.subgroup_min_size)),
        ("subgroup_max_size", u64::from(c.subgroup_max_size)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn show_adapter(result: &PageResult, ctx: &Context) {
    let a = ctx.adapter();
    let uses = match result.features.is_empty() {
        true => "none of shader-f16, subgroup, timestamp-query".to_string(),
        false => result.features.join(", "),
    };
    let browser = result
        .browser_adapter
        .as_ref()
        .and_then(|v| v.as_object())
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| {
                    v.as_str()
                        .filter(|s| !s.is_empty())
                        .map(|s| format!("{k} {s}"))
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    let mut html = format!(
        "<p><b>{}</b> ({}, {}; driver {} {}; the browser says: {})</p><p>kvattn uses: {}; kernel {}; f16 through \
         unpack2x16float: {}</p><p>adapter features: {}</p><table><tr><th>limit</th>\
         <th>value</th></tr>",
        escape(&a.name),
        escape(&a.backend),
        escape(&a.device_type),
        escape(&a.driver),
        escape(&a.driver_info),
        escape(&browser),
        escape(&uses),
        escape(ctx.caps().attention_kernel.name()),
        if ctx.caps().f16_unpack_exact { "yes (checked)" } else { "no (integer decoder)" },
        escape(&result.adapter_features.join(", ")),
    );
    for (k, v) in &result.limits {
        html += &format!("<tr><td>{k}</td><td class=\"num\">{v}</td></tr>");
    }
    html += "</table>";
    set_html("adapter", &html);
}

fn case_html(index: usize, row: &CaseRow) -> String {
    let num = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.2e}"));
    format!(
        "<tr class=\"{status}\"><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
         <td>{}</td><td>{status}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
         <td class=\"num\">{:.1}</td><td>{}</td></tr>",
        index + 1,
        escape(&row.kernel),
        escape(&row.name),
        escape(&row.format),
        escape(&row.precision),
        num(row.max_error),
        num(row.bound),
        row.seconds * 1e3,
        escape(row.note.as_deref().unwrap_or("")),
        status = row.status,
    )
}

fn show_decode(step: &DecodeStep) {
    let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    let times: Vec<String> = step.step_ms.iter().map(|t| format!("{t:.1}")).collect();
    let html = match &step.error {
        Some(e) => format!(
            "<p class=\"fail\">the toy decoder failed: {}</p>",
            escape(e)
        ),
        None => format!(
            "<p class=\"{}\">toy decoder (2 layers, d_model 128, GQA 8:2, vocab 512, random \
             weights, f32 paged KV): {}-token prefill {:.1} ms, then {} decode steps of {} ms \
             (the first compiles its pipelines); tokens {} (reference {}), largest logit error \
             {:.2e} (bound {:.2e}): {}</p>",
            if step.passed { "pass" } else { "fail" },
            step.prompt,
            step.prefill_ms,
            step.steps,
            times.join(" and "),
            list(&step.tokens),
            list(&step.reference_tokens),
            step.max_error,
            step.bound,
            if step.passed { "pass" } else { "FAIL" },
        ),
    };
    set_html("decoder", &html);
}

/// The whole page.
pub async fn run(query: &str, browser_adapter: &str) {
    install_panic_hook();
    let mut result = PageResult {
        browser_adapter: serde_json::from_str(browser_adapter)
            .ok()
            .filter(|v: &serde_json::Value| !v.is_null()),
        ..Default::default()
    };
    let selection = match Selection::parse(query) {
        Ok(s) => s,
        Err(e) => {
            result.webgpu = has_webgpu();
            result.error = Some(format!("bad URL options: {e}"));
            status(result.error.as_deref().unwrap_or_default(), "fail");
            publish(&result, true);
            return;
        }
    };
    result.selection = selection.describe();
    if !has_webgpu() {
        result.error = Some(
            "this browser has no WebGPU (navigator.gpu is missing): open the page in a browser \
             with WebGPU enabled (Chrome or Edge 113 and later, Safari 26, Firefox 141 on \
             Windows), served over http://localhost or https"
                .into(),
        );
        status(result.error.as_deref().unwrap_or_default(), "fail");
        publish(&result, true);
        return;
    }
    status("opening WebGPU...", "");
    match adapter_features().await {
        Ok(features) => result.adapter_features = features,
        Err(e) => {
            result.error = Some(format!(
                "this browser has no WebGPU adapter: navigator.gpu is there but gave none \
                 (WebGPU switched off, or the GPU blocklisted: see chrome://gpu in Chrome): {e}"
            ));
            status(result.error.as_deref().unwrap_or_default(), "fail");
            publish(&result, true);
            return;
        }
    }
    let opts = ContextOptions {
        backends: Some(wgpu::Backends::BROWSER_WEBGPU),
        ..Default::default()
    };
    let ctx = match Context::new_async(&opts).await {
        Ok(ctx) => ctx,
        Err(e) => {
            result.error = Some(format!("opening the device: {e}"));
            status(result.error.as_deref().unwrap_or_default(), "fail");
            publish(&result, true);
            return;
        }
    };
    result.webgpu = true;
    result.adapter = Some(ctx.adapter().clone());
    result.attention_kernel = ctx.caps().attention_kernel.name().to_string();
    result.features = ctx
        .caps()
        .feature_names()
        .into_iter()
        .map(str::to_string)
        .collect();
    result.limits = limits(&ctx);
    show_adapter(&result, &ctx);
    publish(&result, false);

    status(&format!("verifying ({})...", result.selection), "");
    let shared = Rc::new(RefCell::new(result));
    let progress_result = Rc::clone(&shared);
    let mut progress = move |p: &Progress| match p {
        Progress::CaseStarted {
            index, total, name, ..
        } => status(&format!("case {}/{total}: {name}", index + 1), ""),
        Progress::CaseFinished { case, .. } => {
            let mut r = progress_result.borrow_mut();
            if r.first_result_ms.is_none() {
                r.first_result_ms = Some(now_ms());
            }
            let row = CaseRow::new(case);
            append_html("cases", &case_html(case.index, &row));
            r.cases.push(row);
            publish(&r, false);
        }
        _ => {}
    };
    let started = now_ms();
    let report = verify::run_async(&ctx, &selection.options, &mut progress).await;
    drop(progress);
    let mut result = Rc::try_unwrap(shared)
        .map(RefCell::into_inner)
        .unwrap_or_else(|shared| std::mem::take(&mut *shared.borrow_mut()));
    result.verify_seconds = (now_ms() - started) / 1e3;
    match report {
        Ok(report) => {
            result.passed = report.passed;
            result.failed = report.failed;
            result.skipped = report.unavailable;
        }
        Err(e) => result.error = Some(format!("the verification grid could not run: {e}")),
    }
    publish(&result, false);

    if !selection.skip_decoder {
        status("toy decoder step...", "");
        let step = crate::toy::decode_steps(&ctx)
            .await
            .unwrap_or_else(|e| DecodeStep {
                prompt: 0,
                steps: 0,
                max_error: f64::NAN,
                bound: f64::NAN,
                passed: false,
                tokens: Vec::new(),
                reference_tokens: Vec::new(),
                prefill_ms: 0.0,
                step_ms: Vec::new(),
                error: Some(e.to_string()),
            });
        show_decode(&step);
        result.decode = Some(step);
    }
    result.total_seconds = now_ms() / 1e3;
    let decoder_ok = result.decode.as_ref().is_none_or(|d| d.passed);
    let ok = result.error.is_none() && result.failed == 0 && decoder_ok;
    let summary = format!(
        "{}: {} passed, {} failed, {} skipped (the adapter cannot run them; see notes) in \
         {:.1} s; first result {:.0} ms after the page started loading",
        if ok { "all passed" } else { "FAILED" },
        result.passed,
        result.failed,
        result.skipped,
        result.verify_seconds,
        result.first_result_ms.unwrap_or(f64::NAN),
    );
    match &result.error {
        Some(e) => status(&format!("{summary}; {e}"), "fail"),
        None => status(&summary, if ok { "pass" } else { "fail" }),
    }
    publish(&result, true);
}
