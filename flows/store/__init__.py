"""The Arrow results store: one Hive-partitioned folder per table, run manifests, the layout migration."""
