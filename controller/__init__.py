"""Shardline's Kubernetes operator: the ShardlineModel resource, its reconcile and the kopf handlers."""
