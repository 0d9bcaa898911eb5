//! Names the filter, the Envoy bootstrap and the resources toolgate-xds serves all use: a
//! contract between `filter/` and `xds-server/`.

/// Set on the request (Envoy's own copy: it already went upstream) while the filter holds a
/// JSON answer until it is complete, to the MCP reply for that answer cut off. If the upstream
/// then resets, Envoy answers by itself, past every filter; the bootstrap's local-reply mapping
/// sees this header and sends its value instead of its plain-text 503. One header set, where a
/// mark and a filter-state property took two host calls per held answer.
pub const HELD_HEADER: &str = "x-toolgate-held";

/// Prefix of every service's cluster name: service `inventory` is cluster `mcp.inventory`.
pub const SERVICE_CLUSTER_PREFIX: &str = "mcp.";

/// The cluster of `service`.
pub fn service_cluster(service: &str) -> String {
    format!("{SERVICE_CLUSTER_PREFIX}{service}")
}

/// The cluster a request to `/mcp/<service>` goes to, set by the filter: the route that every
/// service without routes of its own shares (toolgate-xds's shared route configuration) picks
/// its cluster by this header, so a new service needs a cluster and no new route. The filter
/// takes the client's copy off every request, and sets it only from the path it judges, so the
/// service it judges is the cluster the call reaches.
pub const CLUSTER_HEADER: &str = "x-toolgate-cluster";

/// The cluster of toolgate-xds's admin listeners: the aggregate endpoint's routes, the
/// filter's reports and held-session requests. The bootstrap defines it; toolgate-xds serves
/// its endpoints.
pub const CONTROL_CLUSTER: &str = "toolgate_control";

/// Prefix of the public path of a service: `/mcp/<service>`. toolgate-xds routes it to the
/// service's cluster; the filter reads the service from it.
pub const SERVICE_PATH_PREFIX: &str = "/mcp/";

/// The aggregate endpoint: one MCP server over every service, virtual server `default`. An
/// exact path, so it never overlaps `/mcp/<service>`.
pub const AGGREGATE_PATH: &str = "/mcp";

/// Named virtual servers are served at `/virtual/<name>`, outside `/mcp/`: no service name
/// can reach them, whatever it is.
pub const VIRTUAL_PATH_PREFIX: &str = "/virtual/";
