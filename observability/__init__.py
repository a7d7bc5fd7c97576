"""How the platform is watched: traces, SLOs, rules and dashboards (imports the kernel only)."""
