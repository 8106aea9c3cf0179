"""Tenants and their API keys: the data (:mod:`.models`), key minting and hashing
(:mod:`.keys`), the Redis store (:mod:`.store`) and request authentication
(:mod:`.auth`). The admin CLI (:mod:`tandem.gateway.admin`) and the route
handlers are the callers."""
