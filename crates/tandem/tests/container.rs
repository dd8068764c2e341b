//! The container image and the Kubernetes manifest: `examples/kubernetes/pytorchjob.yaml`
//! parses, its pods run `tandem train` with flags `train` accepts, and the variables Kubeflow's
//! training operator gives each pod place every rank through Tandem's own reader; the
//! `Dockerfile` builds and its image runs where a container engine answers (skipped with the
//! reason elsewhere).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Map, Value};
use tandem_dist::cluster::{worker_env, ClusterSource, EnvMap};

/// The repository's root.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One meaningful line of a YAML file: its indentation and its text without the comment.
struct Line {
    number: usize,
    indent: usize,
    text: String,
}

/// Reads the block-style subset of YAML that Kubernetes manifests use (mappings, sequences,
/// plain and double-quoted scalars, `{}` and `[]`, comments) into JSON values; anything else
/// (tabs, anchors, flow collections with content, multi-line scalars) is an error naming the
/// line, so the check never passes a file it did not understand.
fn parse_yaml_subset(text: &str) -> Result<Value, String> {
    let mut lines = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        if raw.contains('\t') {
            return Err(format!("line {number}: a tab"));
        }
        let content = strip_comment(raw);
        if content.trim().is_empty() {
            continue;
        }
        let indent = content.len() - content.trim_start().len();
        lines.push(Line {
            number,
            indent,
            text: content.trim().to_string(),
        });
    }
    let mut next = 0;
    let value = parse_node(&mut lines, &mut next, 0)?;
    match lines.get(next) {
        Some(line) => Err(format!("line {}: unexpected indentation", line.number)),
        None => Ok(value),
    }
}

/// `raw` without a comment (`#` at the start or after a space, outside double quotes).
fn strip_comment(raw: &str) -> &str {
    let mut quoted = false;
    let mut previous = ' ';
    for (position, character) in raw.char_indices() {
        match character {
            '"' => quoted = !quoted,
            '#' if !quoted && previous == ' ' => return &raw[..position],
            _ => {}
        }
        previous = character;
    }
    raw
}

/// The mapping or sequence whose lines start at `lines[*next]`, indented by `indent`.
fn parse_node(lines: &mut [Line], next: &mut usize, indent: usize) -> Result<Value, String> {
    let Some(first) = lines.get(*next) else {
        return Err("the file ends where a value was expected".into());
    };
    if first.indent != indent {
        return Err(format!("line {}: unexpected indentation", first.number));
    }
    if first.text == "-" || first.text.starts_with("- ") {
        parse_sequence(lines, next, indent)
    } else {
        parse_mapping(lines, next, indent)
    }
}

fn parse_sequence(lines: &mut [Line], next: &mut usize, indent: usize) -> Result<Value, String> {
    let mut items = Vec::new();
    while let Some(line) = lines.get(*next) {
        if line.indent != indent || !(line.text == "-" || line.text.starts_with("- ")) {
            break;
        }
        let number = line.number;
        let rest = line.text[1..].trim_start().to_string();
        if rest.is_empty() {
            *next += 1;
            match lines.get(*next) {
                Some(child) if child.indent > indent => {
                    let deeper = child.indent;
                    items.push(parse_node(lines, next, deeper)?);
                }
                _ => return Err(format!("line {number}: an empty sequence item")),
            }
        } else if split_key(&rest).is_some() {
            // "- key: value" opens a mapping whose keys line up after the dash.
            lines[*next].indent = indent + 2;
            lines[*next].text = rest;
            items.push(parse_mapping(lines, next, indent + 2)?);
        } else {
            items.push(parse_scalar(&rest, number)?);
            *next += 1;
        }
    }
    Ok(Value::Array(items))
}

fn parse_mapping(lines: &mut [Line], next: &mut usize, indent: usize) -> Result<Value, String> {
    let mut map = Map::new();
    while let Some(line) = lines.get(*next) {
        if line.indent != indent {
            break;
        }
        let number = line.number;
        let (key, value) =
            split_key(&line.text).ok_or_else(|| format!("line {number}: expected `key: value`"))?;
        let (key, value) = (key.to_string(), value.to_string());
        *next += 1;
        let parsed = if value.is_empty() {
            match lines.get(*next) {
                Some(child) if child.indent > indent => parse_node(lines, next, child.indent)?,
                Some(child) if child.indent == indent && child.text.starts_with("- ") => {
                    parse_sequence(lines, next, indent)?
                }
                _ => Value::Null,
            }
        } else {
            parse_scalar(&value, number)?
        };
        if map.insert(key.clone(), parsed).is_some() {
            return Err(format!("line {number}: `{key}` appears twice"));
        }
    }
    Ok(Value::Object(map))
}

/// `key: value` or `key:` split at the first `: ` (or a final `:`), outside quotes.
fn split_key(text: &str) -> Option<(&str, &str)> {
    if text.starts_with('"') {
        return None;
    }
    if let Some(key) = text.strip_suffix(':') {
        return (!key.contains(": ")).then_some((key, ""));
    }
    text.split_once(": ")
        .map(|(key, value)| (key.trim(), value.trim()))
}

fn parse_scalar(text: &str, number: usize) -> Result<Value, String> {
    match text {
        "{}" => return Ok(Value::Object(Map::new())),
        "[]" => return Ok(Value::Array(Vec::new())),
        "true" => return Ok(Value::Bool(true)),
        "false" => return Ok(Value::Bool(false)),
        _ => {}
    }
    if let Some(inner) = text.strip_prefix('"') {
        let inner = inner
            .strip_suffix('"')
            .ok_or_else(|| format!("line {number}: an unclosed quote"))?;
        if inner.contains(['"', '\\']) {
            return Err(format!("line {number}: escapes are not in the subset"));
        }
        return Ok(Value::String(inner.to_string()));
    }
    if text.starts_with(['{', '[', '&', '*', '!', '|', '>', '\'']) {
        return Err(format!("line {number}: `{text}` is not in the subset"));
    }
    Ok(match text.parse::<i64>() {
        Ok(number) => Value::from(number),
        Err(_) => Value::String(text.to_string()),
    })
}

/// A field of a JSON value by path, failing the test with the path when it is missing.
fn field<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(value, |value, key| {
        value
            .get(key)
            .unwrap_or_else(|| panic!("the manifest has no `{}`", path.join(".")))
    })
}

#[test]
fn the_subset_reader_reads_what_it_claims_and_refuses_the_rest() {
    let text = "# top\na:\n  b: 1\n  c: \"x # y\"  # note\n  d:\n    - e: f\n      g: []\n    - plain\nh: {}\n";
    let expected = serde_json::json!({
        "a": {"b": 1, "c": "x # y", "d": [{"e": "f", "g": []}, "plain"]},
        "h": {}
    });
    assert_eq!(parse_yaml_subset(text), Ok(expected));
    let refused = [
        ("a: &anchor 1\n", "line 1: `&anchor 1` is not in the subset"),
        ("a:\n  b: 1\n c: 2\n", "line 3: unexpected indentation"),
        ("a: 1\na: 2\n", "line 2: `a` appears twice"),
        ("a:\n\t- 1\n", "line 2: a tab"),
    ];
    for (text, error) in refused {
        assert_eq!(parse_yaml_subset(text), Err(error.into()));
    }
}

#[test]
fn the_pytorchjob_manifest_places_every_pod_through_tandems_kubeflow_reader() {
    let path = repository().join("examples/kubernetes/pytorchjob.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    let manifest =
        parse_yaml_subset(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    assert_eq!(manifest["apiVersion"], "kubeflow.org/v1");
    assert_eq!(manifest["kind"], "PyTorchJob");
    let job_name = field(&manifest, &["metadata", "name"])
        .as_str()
        .expect("a name");
    let replica_specs = field(&manifest, &["spec", "pytorchReplicaSpecs"]);

    // What the training operator gives each pod: the master's service, the port named
    // pytorchjob-port of the container named pytorch, the replicas in all, the pod's rank.
    let mut pods = Vec::new();
    for replica_type in ["Master", "Worker"] {
        let spec = field(replica_specs, &[replica_type]);
        let replicas = spec["replicas"].as_u64().expect("replicas") as usize;
        let containers = field(spec, &["template", "spec", "containers"])
            .as_array()
            .expect("containers");
        let container = containers
            .iter()
            .find(|container| container["name"] == "pytorch")
            .unwrap_or_else(|| panic!("{replica_type} has no container named pytorch"));
        for index in 0..replicas {
            pods.push((replica_type, index, container.clone()));
        }
    }
    assert_eq!(pods.first().map(|pod| pod.1), Some(0), "one master first");
    let world_size = pods.len();
    assert!(world_size >= 2, "a job of one pod tests nothing");

    let dir = tempfile::tempdir().unwrap();
    let mut ranks = Vec::new();
    for (replica_type, index, container) in &pods {
        let port = container["ports"]
            .as_array()
            .and_then(|ports| ports.iter().find(|port| port["name"] == "pytorchjob-port"))
            .and_then(|port| port["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("{replica_type} names no port pytorchjob-port"));
        let rank = match *replica_type {
            "Master" => *index,
            _ => index + 1,
        };
        let mut env: EnvMap = [
            ("MASTER_ADDR", format!("{job_name}-master-0")),
            ("MASTER_PORT", port.to_string()),
            ("WORLD_SIZE", world_size.to_string()),
            ("RANK", rank.to_string()),
            ("PYTHONUNBUFFERED", "0".to_string()),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
        // The manifest's own variables: the job token from a secret, nothing that would
        // override the operator's.
        let declared = container["env"].as_array().expect("an env list");
        let token = declared
            .iter()
            .find(|variable| variable["name"] == "TANDEM_JOB_TOKEN")
            .unwrap_or_else(|| panic!("{replica_type} does not set TANDEM_JOB_TOKEN"));
        assert!(
            token["valueFrom"]["secretKeyRef"]["name"].is_string(),
            "TANDEM_JOB_TOKEN must come from a secret"
        );
        for variable in declared {
            let name = variable["name"].as_str().expect("a name");
            assert!(
                !env.contains_key(name),
                "{replica_type} overrides the operator's {name}"
            );
            env.insert(name.to_string(), "from-the-manifest".to_string());
        }
        let worker = worker_env(&env)
            .unwrap_or_else(|error| panic!("{replica_type}-{index}: {error}"))
            .unwrap_or_else(|| panic!("{replica_type}-{index}: no cluster detected"));
        assert_eq!(worker.source, ClusterSource::Kubeflow);
        assert_eq!(
            (
                worker.world_size,
                worker.local_rank,
                worker.local_world_size
            ),
            (world_size, 0, 1)
        );
        assert_eq!(
            worker.master_addr.as_deref(),
            Some(format!("{job_name}-master-0").as_str())
        );
        assert_eq!(worker.master_port, Some(port as u16));
        ranks.push(worker.rank);

        // The pod's command is `tandem train` with flags train accepts: run them here with
        // nothing to train and no cluster around.
        let command: Vec<String> = container["command"]
            .as_array()
            .expect("a command")
            .iter()
            .map(|word| word.as_str().expect("words").to_string())
            .collect();
        assert_eq!(
            command[..2],
            ["tandem", "train"],
            "{replica_type}'s command"
        );
        let args = with_flag(command[1..].to_vec(), "--epochs", "0");
        let args = with_flag(
            args,
            "--output-dir",
            &dir.path().join("run").display().to_string(),
        );
        let stdout = expect_success(&run_bounded(
            tandem().args(&args).env_remove("PET_NNODES"),
            Duration::from_secs(60),
        ));
        assert_contains(&stdout, "--epochs is 0: nothing to train");
    }
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        (0..world_size).collect::<Vec<_>>(),
        "every rank once"
    );
}

/// The container engine to build with, or why there is none.
fn container_engine() -> Result<&'static str, String> {
    let mut problems = Vec::new();
    for engine in ["docker", "podman"] {
        match run_with_limit(Command::new(engine).arg("info"), Duration::from_secs(30)) {
            Ok(output) if output.status.success() => return Ok(engine),
            Ok(output) => problems.push(format!(
                "`{engine} info` failed: {}",
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            )),
            Err(error) => problems.push(format!("{engine}: {error}")),
        }
    }
    Err(problems.join("; "))
}

/// Runs `command` within `limit`; an error when it cannot start or runs past the limit.
fn run_with_limit(command: &mut Command, limit: Duration) -> Result<std::process::Output, String> {
    let mut child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|error| format!("cannot start it: {error}"))?;
    let deadline = std::time::Instant::now() + limit;
    while child
        .try_wait()
        .map_err(|error| error.to_string())?
        .is_none()
    {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("no answer within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().map_err(|error| error.to_string())
}

#[test]
fn the_image_builds_and_runs_tandem_where_a_container_engine_answers() {
    let engine = match container_engine() {
        Ok(engine) => engine,
        Err(reason) => {
            eprintln!("skipped the image build: no container engine answers ({reason})");
            return;
        }
    };
    let tag = format!("tandem-test:{}", std::process::id());
    // A full release build inside the image: minutes, not seconds.
    let build = run_with_limit(
        Command::new(engine)
            .args(["build", "-t", &tag, "."])
            .current_dir(repository()),
        Duration::from_secs(45 * 60),
    )
    .unwrap_or_else(|error| panic!("{engine} build: {error}"));
    assert!(
        build.status.success(),
        "{engine} build failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = run_with_limit(
        Command::new(engine).args(["run", "--rm", &tag, "--version"]),
        Duration::from_secs(120),
    );
    let _ = run_with_limit(
        Command::new(engine).args(["rmi", "-f", &tag]),
        Duration::from_secs(120),
    );
    let run = run.unwrap_or_else(|error| panic!("{engine} run: {error}"));
    assert!(
        String::from_utf8_lossy(&run.stdout).starts_with("tandem "),
        "the image's tandem --version said:\n{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
