"""`shardline router`: one endpoint over many `shardline serve` replicas (see README.md here and docs/routing.md)."""
