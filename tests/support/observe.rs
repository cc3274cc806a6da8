//! What a gateway shows of itself: its `/admin/targets` entries and its
//! `/metrics` series. Each gateway has its own metrics registry, so what a
//! test reads here is its own gateway's counts, exactly.

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

/// The value of one series on a Prometheus text page, written as rendered
/// (`name{label="value",...}`, labels in their order); `None` if absent.
pub fn series_value(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// The gateway's `/metrics` page.
pub async fn metrics_page(gw: &Gw) -> String {
    let page = get(gw.addr, "/metrics").await;
    assert_eq!(page.status, 200, "{}", page.text());
    page.text()
}

/// The value of one series on the gateway's `/metrics`; 0 if absent (a
/// counter that never counted).
pub async fn metric(gw: &Gw, series: &str) -> f64 {
    series_value(&metrics_page(gw).await, series).unwrap_or(0.0)
}

/// `switchyard_config_reloads_total{result=RESULT}` (`ok` or `error`; the
/// first load counts as one `ok`).
pub async fn reloads(gw: &Gw, result: &str) -> f64 {
    metric(
        gw,
        &format!("switchyard_config_reloads_total{{result=\"{result}\"}}"),
    )
    .await
}
