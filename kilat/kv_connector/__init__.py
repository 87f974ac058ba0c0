"""KV connectors: moving KV blocks between an engine and the world outside it (offload tiers, other engines),
behind vLLM's ``KVConnectorBase_V1`` interface (:mod:`kilat.kv_connector.base`)."""
