//! Two network namespaces joined by a veth pair: two "hosts" on one machine for the
//! multi-node tests (they need root and `ip`).

use std::process::Command;

/// Two network namespaces joined by a veth pair, removed when dropped.
pub struct NetworkPair {
    /// The namespaces' names.
    pub names: [String; 2],
    /// The veth ends, one in each namespace.
    pub veths: [String; 2],
    /// The first three octets of the pair's /24 (`10.201.0`): the ends are `.1` and `.2`.
    subnet: &'static str,
}

impl NetworkPair {
    /// Namespaces `{prefix}{tag}a` and `{prefix}{tag}b` joined by the veth ends
    /// `{veth}{tag}a` and `{veth}{tag}b`, with the addresses `{subnet}.1` and `{subnet}.2`.
    pub fn create(
        prefix: &str,
        veth: &str,
        subnet: &'static str,
        tag: &str,
    ) -> Result<NetworkPair, String> {
        let names = [format!("{prefix}{tag}a"), format!("{prefix}{tag}b")];
        let (veth_a, veth_b) = (format!("{veth}{tag}a"), format!("{veth}{tag}b"));
        let pair = NetworkPair {
            names: names.clone(),
            veths: [veth_a.clone(), veth_b.clone()],
            subnet,
        };
        let [a, b] = &names;
        let (address_a, address_b) = (
            format!("{}/24", pair.address(0)),
            format!("{}/24", pair.address(1)),
        );
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", a],
            vec!["netns", "add", b],
            vec![
                "link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b,
            ],
            vec!["link", "set", &veth_a, "netns", a],
            vec!["link", "set", &veth_b, "netns", b],
            vec!["-n", a, "addr", "add", &address_a, "dev", &veth_a],
            vec!["-n", b, "addr", "add", &address_b, "dev", &veth_b],
            vec!["-n", a, "link", "set", &veth_a, "up"],
            vec!["-n", b, "link", "set", &veth_b, "up"],
            vec!["-n", a, "link", "set", "lo", "up"],
            vec!["-n", b, "link", "set", "lo", "up"],
        ];
        for step in steps {
            let output = Command::new("ip")
                .args(&step)
                .output()
                .map_err(|error| format!("ip: {error}"))?;
            if !output.status.success() {
                return Err(format!(
                    "ip {}: {}",
                    step.join(" "),
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
        Ok(pair)
    }

    /// The address of end `index` (0 or 1).
    pub fn address(&self, index: usize) -> String {
        format!("{}.{}", self.subnet, index + 1)
    }

    /// `ip netns exec NAME program` for namespace `index`; arguments follow.
    pub fn exec(&self, index: usize, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.names[index], program]);
        command
    }
}

impl NetworkPair {
    /// `ip netns exec NAME program` for namespace `index`, as a host of its own: the
    /// processes see `boot_id` as the kernel's boot id, so that the other namespace's never
    /// reach them through Unix sockets or shared memory, only through the link.
    pub fn exec_as_own_host(
        &self,
        index: usize,
        boot_id: &std::path::Path,
        program: &str,
    ) -> Command {
        let mut command = self.exec(index, "unshare");
        command
            .args(["--mount", "sh", "-c"])
            .arg(r#"mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@""#)
            .arg(boot_id)
            .arg(program);
        command
    }

    /// Takes the link of namespace `index` down (`ip -n NAME link set VETH down`): no packet
    /// passes any more, and no connection is told.
    pub fn link_down(&self, index: usize) -> Result<(), String> {
        let output = Command::new("ip")
            .args([
                "-n",
                &self.names[index],
                "link",
                "set",
                &self.veths[index],
                "down",
            ])
            .output()
            .map_err(|error| format!("ip: {error}"))?;
        match output.status.success() {
            true => Ok(()),
            false => Err(String::from_utf8_lossy(&output.stderr).into_owned()),
        }
    }
}

impl Drop for NetworkPair {
    fn drop(&mut self) {
        // Deleting a namespace also deletes the veth end inside it, and with it the peer.
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "delete", name]).output();
        }
    }
}

/// Why two network namespaces cannot be made here, if they cannot: it needs root, `ip`, and
/// the right to create network namespaces (a container may lack it). `prefix` names the
/// probe namespace.
pub fn network_namespaces_unavailable(prefix: &str) -> Option<String> {
    // SAFETY: `geteuid` has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not running as root".into());
    }
    let probe = format!("{prefix}probe{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(output) if output.status.success() => {
            let _ = Command::new("ip")
                .args(["netns", "delete", &probe])
                .output();
            None
        }
        Ok(output) => Some(format!(
            "`ip netns add` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Err(error) => Some(format!("no `ip` command: {error}")),
    }
}
