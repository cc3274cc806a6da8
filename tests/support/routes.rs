//! routes.yaml builders (a chain of targets, each on its own provider) and
//! a compile check for files that must be rejected.

/// A routes.yaml with one task `chat` (alias `gpt-4o`) whose chain is the
/// given (name, url) targets in order, each on its own provider.
pub fn chain_config(targets: &[(&str, &str)], extra_provider: &str, budget: &str) -> String {
    let mut y = String::from("version: 1\nproviders:\n");
    for (name, url) in targets {
        y.push_str(&format!(
            "  p-{name}:\n    base_url: {url}\n    timeout: 2s\n    connect_timeout: 500ms\n    retry: {{ max: 1, backoff: 10ms }}\n{extra_provider}"
        ));
    }
    y.push_str("targets:\n");
    for (name, _) in targets {
        y.push_str(&format!(
            "  {name}: {{ provider: p-{name}, model: upstream-{name} }}\n"
        ));
    }
    let names: Vec<&str> = targets.iter().map(|(n, _)| *n).collect();
    y.push_str(&format!(
        "tasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [{}]\n{budget}",
        names.join(", ")
    ));
    y
}

/// One hop of a chain: a target on its own provider `p-{name}`.
pub struct Hop {
    name: String,
    url: String,
    provider: String,
    target: String,
}

/// A hop named `name` whose provider points at `url`.
pub fn hop(name: &str, url: &str) -> Hop {
    Hop {
        name: name.to_owned(),
        url: url.to_owned(),
        provider: String::new(),
        target: String::new(),
    }
}

impl Hop {
    /// Adds YAML under the provider (written unindented; indented here).
    /// A `timeout`, `connect_timeout` or `retry` key given here replaces the default.
    pub fn provider(mut self, yaml: &str) -> Self {
        for line in yaml.lines() {
            self.provider.push_str("    ");
            self.provider.push_str(line);
            self.provider.push('\n');
        }
        self
    }

    /// Adds inline fields to the target, e.g. `max_context: 8000`.
    pub fn target(mut self, fields: &str) -> Self {
        self.target.push_str(", ");
        self.target.push_str(fields);
        self
    }
}

/// A routes.yaml with one task `chat` (alias `gpt-4o`) over `hops` in order.
/// `task` is YAML under the task (unindented), `top` is appended at top level.
pub fn routes(hops: &[Hop], task: &str, top: &str) -> String {
    let defaults = [
        ("timeout", "2s"),
        ("connect_timeout", "500ms"),
        ("retry", "{ max: 1, backoff: 10ms }"),
    ];
    let mut y = String::from("version: 1\nproviders:\n");
    for h in hops {
        y.push_str(&format!("  p-{}:\n    base_url: {}\n", h.name, h.url));
        for (key, value) in defaults {
            let given = h.provider.lines().any(|l| {
                l.strip_prefix("    ")
                    .is_some_and(|r| r.starts_with(&format!("{key}:")))
            });
            if !given {
                y.push_str(&format!("    {key}: {value}\n"));
            }
        }
        y.push_str(&h.provider);
    }
    y.push_str("targets:\n");
    for h in hops {
        y.push_str(&format!(
            "  {0}: {{ provider: p-{0}, model: upstream-{0}{1} }}\n",
            h.name, h.target
        ));
    }
    let names: Vec<&str> = hops.iter().map(|h| h.name.as_str()).collect();
    y.push_str(&format!(
        "tasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [{}]\n",
        names.join(", ")
    ));
    for line in task.lines() {
        y.push_str("    ");
        y.push_str(line);
        y.push('\n');
    }
    y.push_str(top);
    y
}

/// Parses and compiles `text` (a whole routes.yaml), expecting it to be rejected.
pub fn compile_errors(text: &str) -> Vec<switchyard::config::diagnostic::Diagnostic> {
    let parsed = switchyard::config::parse(text).unwrap();
    switchyard::snapshot::compile::compile(
        &parsed,
        text,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    )
    .map(|_| ())
    .unwrap_err()
}
