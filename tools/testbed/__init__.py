"""A home on one machine: unlike devices with real limits (cgroups), their own network namespaces, and links
shaped in user space, each running an unchanged prima-node. `python -m tools.testbed --help`; docs/testbed.md."""
