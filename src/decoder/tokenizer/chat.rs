//! Chat prompts: the model file's Jinja template rendered with MiniJinja, set up as Hugging
//! Face's `apply_chat_template` sets up Jinja2: blocks trimmed (`trim_blocks`, `lstrip_blocks`),
//! loop controls, no auto-escaping, Python's string methods (`minijinja-contrib`'s `pycompat`),
//! and the functions templates call, `raise_exception` and `strftime_now`.
//!
//! One difference remains: MiniJinja's `tojson` escapes `<`, `>`, `&` and `'` (as `\u003c`, ...)
//! where Hugging Face's writes them as they are; only templates that print tool definitions
//! use it.

use std::sync::{Arc, Mutex};
// `std::time::SystemTime::now` panics on the web; web-time's is the browser's clock there.
use web_time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Value;
use minijinja::{context, AutoEscape, Environment, ErrorKind};

use super::tok_err;
use crate::{Error, Result};

/// What a chat template is rendered with.
pub(super) struct ChatInput<'m> {
    /// `(role, content)` per message.
    pub messages: &'m [(&'m str, &'m str)],
    /// Whether to open the assistant's turn.
    pub add_generation_prompt: bool,
    /// The BOS token's text (empty when the model has none).
    pub bos_token: String,
    /// The EOS token's text (empty when the model has none).
    pub eos_token: String,
}

/// Renders `template` (see the module docs).
///
/// # Errors
/// [`Error::InvalidArgument`] with the template's message when it calls `raise_exception`;
/// [`Error::Tokenizer`] when it does not compile or fails otherwise.
pub(super) fn render(template: &str, input: &ChatInput<'_>) -> Result<String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| tok_err(format!("chat template syntax: {e}")))?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // The message a template raised, kept apart from MiniJinja's own errors.
    let raised: Arc<Mutex<Option<String>>> = Arc::default();
    let cell = Arc::clone(&raised);
    env.add_function(
        "raise_exception",
        move |message: String| -> std::result::Result<Value, minijinja::Error> {
            if let Ok(mut slot) = cell.lock() {
                slot.get_or_insert_with(|| message.clone());
            }
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function(
        "strftime_now",
        |format: String| -> std::result::Result<String, minijinja::Error> {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            strftime(&format, secs)
                .map_err(|m| minijinja::Error::new(ErrorKind::InvalidOperation, m))
        },
    );
    let compiled = env
        .template_from_str(template)
        .map_err(|e| tok_err(format!("chat template does not compile: {}", describe(&e))))?;
    let messages: Value = input
        .messages
        .iter()
        .map(|&(role, content)| context! { role => role, content => content })
        .collect();
    // As Hugging Face passes them: no tools and no documents are `none`, not undefined
    // (`tools is not none` must be false).
    let rendered = compiled.render(context! {
        messages => messages,
        tools => Value::from(()),
        documents => Value::from(()),
        add_generation_prompt => input.add_generation_prompt,
        bos_token => input.bos_token.as_str(),
        eos_token => input.eos_token.as_str(),
    });
    rendered.map_err(
        |e| match raised.lock().ok().and_then(|mut slot| slot.take()) {
            Some(message) => Error::InvalidArgument(format!(
                "the chat template refuses the conversation: {message}"
            )),
            None => tok_err(format!("chat template failed: {}", describe(&e))),
        },
    )
}

/// A MiniJinja error with its line, when it has one.
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{e} (template line {line})"),
        None => e.to_string(),
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// The proleptic Gregorian (year, month 1-12, day 1-31) of a day counted from 1970-01-01.
fn civil_date(days: i64) -> (i64, u32, u32) {
    // Eras of 400 years (146097 days) starting on March 1st, so that the leap day ends a year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of the era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year from March 1st
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `format` with the C `strftime` directives `%Y %y %m %d %e %-m %-d %B %b %A %a %H %M %S %j %%`
/// applied to the UTC time `secs` after the Unix epoch; another directive is an error naming it.
fn strftime(format: &str, secs: u64) -> std::result::Result<String, String> {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = civil_date(days);
    let (hour, minute, second) = (rem / 3600, rem / 60 % 60, rem % 60);
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize]; // 1970-01-01 was a Thursday
    let month_name = MONTHS[month as usize - 1];
    let day_of_year = days - {
        let (y, _, _) = civil_date(days);
        days_from_civil(y)
    } + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut d = chars.next();
        let unpadded = d == Some('-');
        if unpadded {
            d = chars.next();
        }
        let piece = match (d, unpadded) {
            (Some('Y'), false) => year.to_string(),
            (Some('y'), false) => format!("{:02}", year.rem_euclid(100)),
            (Some('m'), false) => format!("{month:02}"),
            (Some('m'), true) => month.to_string(),
            (Some('d'), false) => format!("{day:02}"),
            (Some('d'), true) => day.to_string(),
            (Some('e'), false) => format!("{day:>2}"),
            (Some('B'), false) => month_name.to_string(),
            (Some('b'), false) => month_name[..3].to_string(),
            (Some('A'), false) => weekday.to_string(),
            (Some('a'), false) => weekday[..3].to_string(),
            (Some('H'), false) => format!("{hour:02}"),
            (Some('M'), false) => format!("{minute:02}"),
            (Some('S'), false) => format!("{second:02}"),
            (Some('j'), false) => format!("{day_of_year:03}"),
            (Some('%'), false) => "%".to_string(),
            (other, _) => {
                let shown: String = other.map(String::from).unwrap_or_default();
                let dash = if unpadded { "-" } else { "" };
                return Err(format!(
                    "strftime_now: the directive %{dash}{shown} is not supported"
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// The day (counted from 1970-01-01) of January 1st of `year`.
fn days_from_civil(year: i64) -> i64 {
    // Through March 1st of the previous year: eras of 400 years again.
    let y = year - 1;
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doe = 365 * yoe + yoe / 4 - yoe / 100 + 306; // March 1st of y .. January 1st of year
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(-1), (1969, 12, 31));
        assert_eq!(civil_date(59), (1970, 3, 1));
        // 2000-02-29 (a leap day of a year divisible by 400) and 2100-03-01.
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(47_541), (2100, 3, 1));
        for y in [1970, 1999, 2000, 2024, 2025, 2100] {
            assert_eq!(civil_date(days_from_civil(y)), (y, 1, 1), "{y}");
            assert_eq!(civil_date(days_from_civil(y) - 1), (y - 1, 12, 31), "{y}");
        }
        // 2024-07-26 13:05:09 UTC was a Friday, day 208 of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime("%d %b %Y|%-d %B %y|%A %a %H:%M:%S %j %m %-m %e%%", t).unwrap(),
            "26 Jul 2024|26 July 24|Friday Fri 13:05:09 208 07 7 26%"
        );
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
        assert!(strftime("%-Y", 0).unwrap_err().contains("%-Y"));
        assert!(strftime("50%", 0).is_err());
    }

    /// Renders with `<s>`/`</s>` as BOS/EOS.
    fn render_with(template: &str, messages: &[(&str, &str)], gen: bool) -> Result<String> {
        render(
            template,
            &ChatInput {
                messages,
                add_generation_prompt: gen,
                bos_token: "<s>".into(),
                eos_token: "</s>".into(),
            },
        )
    }

    const CONVERSATION: &[(&str, &str)] = &[
        ("system", "  Be brief.\n"),
        ("user", "Hi there "),
        ("assistant", "Hello."),
        ("user", "Bye"),
    ];

    /// In the manner of Llama 3.x: a header per turn, the system message trimmed and taken out
    /// of the loop with a slice, today's date from `strftime_now` unless `date_string` is set.
    const HEADERS: &str = r#"{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
{{- "<|header|>system<|end_header|>\n\nDate: " + date_string + "\n\n" + system + "<|eot|>" }}
{%- for message in messages %}
    {{- '<|header|>' + message['role'] + '<|end_header|>\n\n' + message['content'] | trim + '<|eot|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|header|>assistant<|end_header|>\n\n' }}
{%- endif %}
"#;

    #[test]
    fn headers_template_with_a_date() {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let today = strftime("%d %b %Y", secs).unwrap();
        let out = render_with(HEADERS, CONVERSATION, true).unwrap();
        assert_eq!(
            out,
            format!(
                "<s><|header|>system<|end_header|>\n\nDate: {today}\n\nBe brief.<|eot|>\
                 <|header|>user<|end_header|>\n\nHi there<|eot|>\
                 <|header|>assistant<|end_header|>\n\nHello.<|eot|>\
                 <|header|>user<|end_header|>\n\nBye<|eot|>\
                 <|header|>assistant<|end_header|>\n\n"
            )
        );
        let out = render_with(HEADERS, &[("user", "x")], false).unwrap();
        assert!(
            out.ends_with("\n\n<|eot|><|header|>user<|end_header|>\n\nx<|eot|>"),
            "{out}"
        );
    }

    /// In the manner of Qwen2.5 / Qwen3: ChatML with a default system message, a namespace
    /// carried out of a loop, Python string methods.
    const CHATML: &str = r#"{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if messages[0].role != 'system' %}
    {{- '<|im_start|>system\nYou answer questions.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- if message.content.startswith('<think>') and loop.index0 < ns.last_user %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content.strip() + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"#;

    #[test]
    fn chatml_template_with_namespace_and_string_methods() {
        let out = render_with(
            CHATML,
            &[
                ("user", " What is 2+2? "),
                ("assistant", "<think>easy</think>\n\nFour."),
                ("user", "And 3+3?"),
                ("assistant", "<think>still easy</think>Six."),
            ],
            false,
        )
        .unwrap();
        // The thinking is dropped from turns before the last user message only.
        assert_eq!(
            out,
            "<|im_start|>system\nYou answer questions.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\nFour.<|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n<think>still easy</think>Six.<|im_end|>\n"
        );
        let out = render_with(CHATML, &[("system", "S"), ("user", "U")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// In the manner of Mistral's instruct templates: `[INST]`, roles checked with
    /// `raise_exception`.
    const INST: &str = r#"{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}"#;

    #[test]
    fn inst_template_and_raise_exception() {
        let out = render_with(
            INST,
            &[("user", "a"), ("assistant", "b"), ("user", "c")],
            true,
        )
        .unwrap();
        assert_eq!(out, "<s>[INST] a [/INST] b</s>[INST] c [/INST]");
        let e = render_with(INST, &[("assistant", "b")], true).unwrap_err();
        match e {
            Error::InvalidArgument(m) => {
                assert!(m.contains("Conversation roles must alternate"), "{m}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        let e = render_with(INST, &[("user", "a"), ("tool", "t")], true).unwrap_err();
        assert!(
            e.to_string().contains("Only user and assistant roles"),
            "{e}"
        );
    }

    /// In the manner of Llama 2: `<<SYS>>` folded into the first user turn, block tags on lines
    /// of their own (removed whole by trim_blocks and lstrip_blocks; the output tags keep their
    /// newlines).
    const SYS_BLOCK: &str = "{% if messages[0]['role'] == 'system' %}
  {% set loop_messages = messages[1:] %}
  {% set system_message = messages[0]['content'] %}
{% else %}
  {% set loop_messages = messages %}
  {% set system_message = false %}
{% endif %}
{% for message in loop_messages %}
  {% if loop.first and system_message != false %}
    {% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
  {% else %}
    {% set content = message['content'] %}
  {% endif %}
  {% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
  {% elif message['role'] == 'assistant' %}
{{ ' ' + content.strip() + ' ' + eos_token }}
  {% endif %}
{% endfor %}
";

    #[test]
    fn sys_block_template_with_trimmed_blocks() {
        let out = render_with(SYS_BLOCK, CONVERSATION, true).unwrap();
        assert_eq!(
            out,
            "<s>[INST] <<SYS>>\n  Be brief.\n\n<</SYS>>\n\nHi there [/INST]\n Hello. </s>\n\
             <s>[INST] Bye [/INST]\n"
        );
        let out = render_with(SYS_BLOCK, &[("user", "x")], true).unwrap();
        assert_eq!(out, "<s>[INST] x [/INST]\n");
    }

    #[test]
    fn no_tools_is_none() {
        let t =
            "{% if tools is not none %}tools{% endif %}{% if documents is none %}none{% endif %}\
                 {% if tools %}T{% endif %}{{ messages | length }}";
        assert_eq!(render_with(t, &[("user", "x")], true).unwrap(), "none1");
    }

    #[test]
    fn broken_templates_are_tokenizer_errors() {
        let e = render_with("{% if %}", &[], true).unwrap_err();
        assert!(
            matches!(&e, Error::Tokenizer(m) if m.contains("does not compile")),
            "{e}"
        );
        let e = render_with("{{ no_such_function() }}", &[], true).unwrap_err();
        assert!(
            matches!(&e, Error::Tokenizer(m) if m.contains("failed")),
            "{e}"
        );
        let e = render_with("{{ strftime_now('%Q') }}", &[], true).unwrap_err();
        assert!(matches!(&e, Error::Tokenizer(m) if m.contains("%Q")), "{e}");
    }
}
