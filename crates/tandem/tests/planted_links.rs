//! Symbolic links planted where a run writes are never written through: at the run lock, at
//! the temporary names of the files written atomically (`<name>.<pid>.tmp`), at the
//! TensorBoard event file's name, at the launcher's logs and the workers' error files. Each
//! test plants a link to a file outside the run and checks that the file is untouched, and
//! that the run refuses, naming the link.
//!
//! Names that hold the writer's pid are planted before the process starts: `sh` waits for a
//! line on its standard input, then `exec`s tandem, which keeps the pid `sh` had.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);
const VICTIM_TEXT: &str = "precious, not tandem's\n";

/// A file outside the run that the planted links point to.
fn victim(dir: &Path) -> PathBuf {
    let path = dir.join("victim.txt");
    std::fs::write(&path, VICTIM_TEXT).unwrap();
    path
}

/// A temporary folder holding a victim file and an empty run folder `run`.
fn run_folder() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let victim = victim(dir.path());
    let out = dir.path().join("run");
    std::fs::create_dir(&out).unwrap();
    (dir, victim, out)
}

fn assert_untouched(victim: &Path) {
    assert_eq!(
        std::fs::read_to_string(victim).unwrap(),
        VICTIM_TEXT,
        "the link's target was written"
    );
}

fn plant_link(victim: &Path, at: &Path) {
    std::os::unix::fs::symlink(victim, at).unwrap();
}

/// A `tandem` that starts when released: its pid is known before it runs.
struct HeldStart {
    child: Child,
}

impl HeldStart {
    fn spawn(args: &[String]) -> HeldStart {
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"read go && exec "$0" "$@""#)
            .arg(env!("CARGO_BIN_EXE_tandem"))
            .args(args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("MASTER_ADDR")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        HeldStart { child }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn release(mut self) -> Output {
        let mut stdin = self.child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        drop(stdin);
        wait_bounded(self.child, LIMIT)
    }
}

fn one_epoch_run(out: &Path) -> Vec<String> {
    with_flag(synthetic_run(out, 96), "--epochs", "1")
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_lock_file_that_is_a_link_is_refused_and_its_target_untouched() {
    let (_dir, victim, out) = run_folder();
    let lock = out.join("tandem.lock");
    plant_link(&victim, &lock);
    let output = run_bounded(tandem().args(one_epoch_run(&out)), LIMIT);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_eq!(
        stderr_of(&output),
        format!(
            "error: cannot open lock file {}: it is a symbolic link to {}, not a regular file; \
             tandem writes only regular files: remove it\n",
            lock.display(),
            victim.display()
        )
    );
    assert_untouched(&victim);
    assert!(!out.join("config.toml").exists(), "the run went on");
}

#[test]
fn a_temporary_name_that_is_a_link_is_refused_and_its_target_untouched() {
    // In the order a run writes them: config.toml at the start, then at the epoch's end the
    // history, the checkpoint and the snapshot.
    for name in [
        "config.toml",
        "metrics.jsonl",
        "curves.png",
        "epoch_1.safetensors",
        "snapshot.safetensors",
    ] {
        let (_dir, victim, out) = run_folder();
        let run = HeldStart::spawn(&one_epoch_run(&out));
        let pid = run.pid();
        let temporary = out.join(format!("{name}.{pid}.tmp"));
        plant_link(&victim, &temporary);
        let output = run.release();
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "{name}: {stderr}");
        let expected = format!(
            "error: cannot write {}: cannot create its temporary file {}: the name is taken \
             already, by a symbolic link to {}; tandem writes only files it creates: remove it\n",
            out.join(name).display(),
            temporary.display(),
            victim.display()
        );
        assert!(stderr.ends_with(&expected), "{name}: {stderr}");
        assert_untouched(&victim);
        assert!(
            std::fs::symlink_metadata(&temporary)
                .unwrap()
                .file_type()
                .is_symlink(),
            "{name}: the planted link was removed or replaced"
        );
        assert!(
            !out.join(name).exists(),
            "{name}: {} was written",
            out.join(name).display()
        );
    }
}

#[test]
fn a_file_that_is_a_link_is_replaced_by_the_regular_file_its_target_untouched() {
    // The atomic rename replaces a link at the final name; its target is never opened.
    let (_dir, victim, out) = run_folder();
    plant_link(&victim, &out.join("metrics.jsonl"));
    tandem_succeeds(one_epoch_run(&out), LIMIT);
    assert_untouched(&victim);
    let metrics = out.join("metrics.jsonl");
    assert!(std::fs::symlink_metadata(&metrics)
        .unwrap()
        .file_type()
        .is_file());
    assert_eq!(std::fs::read_to_string(metrics).unwrap().lines().count(), 1);
}

/// This machine's host name, as tandem puts it in event file names.
fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the pointer and length describe `buffer`, which outlives the call.
    assert_eq!(
        unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) },
        0
    );
    let end = buffer.iter().position(|&byte| byte == 0).unwrap();
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

#[test]
fn an_event_file_name_that_is_a_link_is_refused_and_its_target_untouched() {
    let (_dir, victim, out) = run_folder();
    let run = HeldStart::spawn(&one_epoch_run(&out));
    let pid = run.pid();
    let host = host_name();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Every second the run may start in.
    for seconds in now..now + 60 {
        let name = format!("events.out.tfevents.{seconds}.{host}.{pid}");
        plant_link(&victim, &out.join(name));
    }
    let output = run.release();
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let prefix = format!(
        "error: cannot create event file {}",
        out.join("events.out.tfevents.").display()
    );
    let suffix = format!(
        ".{host}.{pid}: the name is taken already, by a symbolic link to {}; tandem writes \
         only files it creates: remove it\n",
        victim.display()
    );
    assert!(
        stderr.contains(&prefix) && stderr.ends_with(&suffix),
        "{stderr}"
    );
    assert_untouched(&victim);
}

/// `tandem launch --log-dir LOGS` of one worker running `script` under `sh`, to its end.
fn launch(dir: &Path, logs: &Path, script: &str) -> Output {
    let mut command = tandem();
    command
        .current_dir(dir)
        .env_remove("TANDEM_JOB_TOKEN")
        .env("TANDEM", env!("CARGO_BIN_EXE_tandem"))
        .args(["launch", "--standalone", "--max-restarts", "0", "--log-dir"])
        .arg(logs)
        .args(["--", "sh", "-c", script]);
    run_bounded(&mut command, LIMIT)
}

#[test]
fn a_rank_log_or_log_folder_that_is_a_link_is_refused_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let victim = victim(dir.path());
    let logs = dir.path().join("job");
    std::fs::create_dir_all(logs.join("logs")).unwrap();
    let log = logs.join("logs/rank_0.log");
    plant_link(&victim, &log);
    let output = launch(dir.path(), &logs, "echo written");
    assert!(!output.status.success(), "{}", stderr_of(&output));
    assert!(
        stderr_of(&output).ends_with(&format!(
            "error: open the log of rank 0 ({}): it is a symbolic link to {}, not a regular \
             file; tandem writes only regular files: remove it\n",
            log.display(),
            victim.display()
        )),
        "{}",
        stderr_of(&output)
    );
    assert_untouched(&victim);

    // A folder of the launcher's that is a link to another folder.
    for folder in ["logs", "errors"] {
        let elsewhere = dir.path().join(format!("elsewhere-{folder}"));
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("rank_0.log"), VICTIM_TEXT).unwrap();
        let logs = dir.path().join(format!("job-{folder}"));
        std::fs::create_dir(&logs).unwrap();
        plant_link(&elsewhere, &logs.join(folder));
        let output = launch(dir.path(), &logs, "echo written");
        assert!(
            stderr_of(&output).ends_with(&format!(
                "error: create the log folder {}: it is a symbolic link to {}, not a folder; \
                 tandem writes only into folders it creates: remove it\n",
                logs.join(folder).display(),
                elsewhere.display()
            )),
            "{}",
            stderr_of(&output)
        );
        assert_untouched(&elsewhere.join("rank_0.log"));
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 1);
    }
}

#[test]
fn an_error_files_temporary_name_that_is_a_link_is_not_written_through() {
    // The worker plants the link at its own temporary name, then becomes tandem (same pid),
    // which refuses a flag and records the error in its error file.
    let dir = tempfile::tempdir().unwrap();
    let victim = victim(dir.path());
    let logs = dir.path().join("job");
    let script = format!(
        r#"ln -s '{}' "$TANDEM_ERROR_FILE.$$.tmp" && exec "$TANDEM" train --epochs -1"#,
        victim.display()
    );
    let output = launch(dir.path(), &logs, &script);
    assert!(!output.status.success(), "{}", stderr_of(&output));
    // Rank 0's output reaches the launcher's standard output, prefixed.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let error_file = logs.join("errors/rank_0.json");
    assert!(
        stdout.contains(&format!(
            "warning: cannot record the error in {}: cannot write {}: cannot create its \
             temporary file {}.",
            error_file.display(),
            error_file.display(),
            error_file.display()
        )) && stdout.contains(&format!(
            ".tmp: the name is taken already, by a symbolic link to {}",
            victim.display()
        )),
        "{stdout}"
    );
    assert_untouched(&victim);
    assert!(!error_file.exists(), "the error file became the link");
}
