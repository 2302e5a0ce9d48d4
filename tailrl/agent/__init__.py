"""Multi-turn agents: tools (functions -> schema), environments, the python sandbox, the tool pool."""
