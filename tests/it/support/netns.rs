//! A network namespace joined to this one by a veth pair, with silent packet loss on its end
//! (nftables `numgen random` rules on the namespace's input and output, so both directions and
//! every protocol alike): a server runs inside, the browser outside. This kernel has no
//! `netem`; loss is what nftables can do. Needs root (or CAP_NET_ADMIN): [`Netns::create`]
//! says why not where it cannot.
#![allow(dead_code)]

use std::process::{Command, Output};

pub struct Netns {
    pub name: String,
    host_if: String,
    ns_if: String,
    /// The host side's address.
    pub host_ip: String,
    /// The namespace's address (where its server listens).
    pub ip: String,
}

fn run(args: &[&str]) -> Result<Output, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// A namespace `dx<pid>` with `10.<a>.<b>.2/24` inside and `.1` outside; `Err` names what
    /// the system refused (the caller skips, saying so).
    pub fn create() -> Result<Netns, String> {
        let pid = std::process::id();
        let name = format!("dx{pid}");
        let (a, b) = (200 + (pid / 250) % 50, pid % 250);
        let ns = Netns {
            host_if: format!("dxh{pid}"),
            ns_if: format!("dxn{pid}"),
            host_ip: format!("10.{a}.{b}.1"),
            ip: format!("10.{a}.{b}.2"),
            name,
        };
        run(&["nft", "--version"])?;
        run(&["ip", "netns", "add", &ns.name])?;
        let setup = || -> Result<(), String> {
            run(&[
                "ip",
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &ns.ns_if,
            ])?;
            run(&["ip", "link", "set", &ns.ns_if, "netns", &ns.name])?;
            run(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", ns.host_ip),
                "dev",
                &ns.host_if,
            ])?;
            run(&["ip", "link", "set", &ns.host_if, "up"])?;
            let inside = |args: &[&str]| {
                let mut a = vec!["ip", "netns", "exec", ns.name.as_str()];
                a.extend_from_slice(args);
                run(&a)
            };
            inside(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", ns.ip),
                "dev",
                &ns.ns_if,
            ])?;
            inside(&["ip", "link", "set", &ns.ns_if, "up"])?;
            inside(&["ip", "link", "set", "lo", "up"])?;
            Ok(())
        };
        setup().map(|()| ns)
    }

    /// Drops `percent` of the packets in each direction on the namespace's link (0: none).
    pub fn set_loss(&self, percent: u32) {
        let _ = run(&[
            "ip", "netns", "exec", &self.name, "nft", "delete", "table", "inet", "impair",
        ]);
        if percent == 0 {
            return;
        }
        let rules = format!(
            "table inet impair {{\n\
             chain in {{ type filter hook input priority 0; iifname \"{i}\" numgen random mod 100 < {percent} drop; }}\n\
             chain out {{ type filter hook output priority 0; oifname \"{i}\" numgen random mod 100 < {percent} drop; }}\n\
             }}\n",
            i = self.ns_if
        );
        let file = std::env::temp_dir().join(format!("{}-impair.nft", self.name));
        std::fs::write(&file, rules).unwrap();
        run(&[
            "ip",
            "netns",
            "exec",
            &self.name,
            "nft",
            "-f",
            file.to_str().unwrap(),
        ])
        .unwrap();
        let _ = std::fs::remove_file(file);
    }

    /// `ip netns exec <name>`, to which the command's program and arguments are added.
    pub fn exec(&self) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "link", "del", &self.host_if]);
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}
