//! What a gateway shows of itself: its `/admin/targets` entries.

use super::{get, Gw};

/// The `/admin/targets` entry of one target.
pub async fn admin_target(gw: &Gw, name: &str) -> serde_json::Value {
    let ans = get(gw.addr, "/admin/targets").await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    ans.json()["targets"]
        .as_array()
        .expect("targets list")
        .iter()
        .find(|t| t["target"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no target {name} in {}", ans.text()))
}
