//! Network namespaces as hosts on one machine for the multi-node tests (they need root and
//! `ip`): two joined by a veth pair, or several on one bridge.

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
        steps.iter().try_for_each(|step| run_ip(step))?;
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
        own_host_command(&self.names[index], boot_id, program)
    }

    /// Takes the link of namespace `index` down (`ip -n NAME link set VETH down`): no packet
    /// passes any more, and no connection is told.
    pub fn link_down(&self, index: usize) -> Result<(), String> {
        take_link_down(&self.names[index], &self.veths[index])
    }

    /// Brings the link of namespace `index` up again: the cut heals.
    pub fn link_up(&self, index: usize) -> Result<(), String> {
        bring_link_up(&self.names[index], &self.veths[index])
    }
}

impl Drop for NetworkPair {
    fn drop(&mut self) {
        // Deleting a namespace also deletes the veth end inside it, and with it the peer.
        delete_namespaces(&self.names);
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

/// Network namespaces as hosts on one switch: a hub namespace holds a bridge, and each host
/// namespace reaches it through a veth pair. Taking a host's link down cuts it off from
/// every other host at once. Removed when dropped.
pub struct NetworkStar {
    hub: String,
    hosts: Vec<String>,
    veths: Vec<String>,
    /// The first three octets of the hosts' /24: host i is at `.{i + 1}`.
    subnet: &'static str,
    /// The hosts on the first switch (`br0`); the others are on `br1`, joined to it by the
    /// trunk.
    first_switch: usize,
    /// The trunk's end on `br0`, when there are two switches.
    trunk: Option<String>,
}

impl NetworkStar {
    /// `count` host namespaces `{prefix}{tag}{i}` on the bridge of namespace `{prefix}{tag}h`,
    /// their veth ends named `{veth}{tag}{i}` (host side) and `{veth}{tag}{i}h` (hub side).
    pub fn create(
        prefix: &str,
        veth: &str,
        subnet: &'static str,
        tag: &str,
        count: usize,
    ) -> Result<NetworkStar, String> {
        NetworkStar::create_split(prefix, veth, subnet, tag, count, count)
    }

    /// [`NetworkStar::create`] with two switches: hosts `0..first_switch` on one, the others
    /// on the other, the switches joined by a trunk link (`{veth}{tag}ta`, `{veth}{tag}tb`).
    /// Cutting the trunk splits the hosts in two parts, each whole.
    pub fn create_split(
        prefix: &str,
        veth: &str,
        subnet: &'static str,
        tag: &str,
        count: usize,
        first_switch: usize,
    ) -> Result<NetworkStar, String> {
        let hub = format!("{prefix}{tag}h");
        let split = first_switch < count;
        let star = NetworkStar {
            hub: hub.clone(),
            hosts: (0..count).map(|i| format!("{prefix}{tag}{i}")).collect(),
            veths: (0..count).map(|i| format!("{veth}{tag}{i}")).collect(),
            subnet,
            first_switch,
            trunk: split.then(|| format!("{veth}{tag}ta")),
        };
        run_ip(&["netns", "add", &hub])?;
        let switches: &[&str] = if split { &["br0", "br1"] } else { &["br0"] };
        for bridge in switches {
            run_ip(&["-n", &hub, "link", "add", bridge, "type", "bridge"])?;
            run_ip(&["-n", &hub, "link", "set", bridge, "up"])?;
        }
        if let Some(trunk) = &star.trunk {
            let other_end = format!("{veth}{tag}tb");
            run_ip(&[
                "-n", &hub, "link", "add", trunk, "type", "veth", "peer", "name", &other_end,
            ])?;
            run_ip(&["-n", &hub, "link", "set", trunk, "master", "br0", "up"])?;
            run_ip(&["-n", &hub, "link", "set", &other_end, "master", "br1", "up"])?;
        }
        for index in 0..count {
            star.attach(index)?;
        }
        Ok(star)
    }

    /// Takes the trunk between the two switches down (`up` false) or up again.
    pub fn set_trunk(&self, up: bool) -> Result<(), String> {
        let trunk = self.trunk.as_deref().ok_or("this star has one switch")?;
        let state = if up { "up" } else { "down" };
        run_ip(&["-n", &self.hub, "link", "set", trunk, state])
    }

    /// Makes host `index`'s namespace and links it to the bridge.
    fn attach(&self, index: usize) -> Result<(), String> {
        let (host, veth, hub) = (&self.hosts[index], &self.veths[index], &self.hub);
        let bridge = if index < self.first_switch {
            "br0"
        } else {
            "br1"
        };
        let hub_end = format!("{veth}h");
        let address = format!("{}/24", self.address(index));
        let steps: [&[&str]; 8] = [
            &["netns", "add", host],
            &[
                "link", "add", veth, "type", "veth", "peer", "name", &hub_end,
            ],
            &["link", "set", veth, "netns", host],
            &["link", "set", &hub_end, "netns", hub],
            &["-n", hub, "link", "set", &hub_end, "master", bridge, "up"],
            &["-n", host, "addr", "add", &address, "dev", veth],
            &["-n", host, "link", "set", veth, "up"],
            &["-n", host, "link", "set", "lo", "up"],
        ];
        steps.iter().try_for_each(|step| run_ip(step))
    }

    /// The address of host `index`.
    pub fn address(&self, index: usize) -> String {
        format!("{}.{}", self.subnet, index + 1)
    }

    /// `program` run in host `index`'s namespace as a host of its own: it sees `boot_id` as
    /// the kernel's boot id, so that the other hosts' processes reach it only through the
    /// link (see [`NetworkPair::exec_as_own_host`]).
    pub fn exec_as_own_host(
        &self,
        index: usize,
        boot_id: &std::path::Path,
        program: &str,
    ) -> Command {
        own_host_command(&self.hosts[index], boot_id, program)
    }

    /// Takes host `index`'s link down: no packet passes any more, and no connection is told.
    pub fn link_down(&self, index: usize) -> Result<(), String> {
        take_link_down(&self.hosts[index], &self.veths[index])
    }

    /// Brings host `index`'s link up again: the cut heals.
    pub fn link_up(&self, index: usize) -> Result<(), String> {
        bring_link_up(&self.hosts[index], &self.veths[index])
    }
}

impl Drop for NetworkStar {
    fn drop(&mut self) {
        delete_namespaces(&self.hosts);
        delete_namespaces(std::slice::from_ref(&self.hub));
    }
}

/// Deletes the network namespaces `names`, with the links inside them.
fn delete_namespaces(names: &[String]) {
    for name in names {
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
    }
}

/// `program` run in namespace `namespace`, seeing `boot_id` as the kernel's boot id.
fn own_host_command(namespace: &str, boot_id: &std::path::Path, program: &str) -> Command {
    let mut command = Command::new("ip");
    command
        .args(["netns", "exec", namespace, "unshare"])
        .args(["--mount", "sh", "-c"])
        .arg(r#"mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@""#)
        .arg(boot_id)
        .arg(program);
    command
}

/// Takes the link `veth` of namespace `namespace` down.
fn take_link_down(namespace: &str, veth: &str) -> Result<(), String> {
    run_ip(&["-n", namespace, "link", "set", veth, "down"])
}

fn bring_link_up(namespace: &str, veth: &str) -> Result<(), String> {
    run_ip(&["-n", namespace, "link", "set", veth, "up"])
}

/// Runs `ip` with `args`, failing with its error output.
fn run_ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|error| format!("ip: {error}"))?;
    match output.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        )),
    }
}
