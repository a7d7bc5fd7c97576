"""The online tier (installed as ``shardline.online``): the HTTP server over the same models as batch.

``shardline serve`` runs it; ``shardline.online.server.build_app`` makes the ASGI app.
"""
