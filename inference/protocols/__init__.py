"""The APIs beside Chat Completions, each a translation at the edge of the one pipeline.

A protocol owns two translations and nothing else:

- its request body → a Chat Completions body (``translate``), which the request's run
  (inference/pipeline.py) validates, tokenizes, admits, dispatches, bills and logs as
  any chat request; the run is opened with the protocol's ``endpoint`` so that its id,
  its request log and its metrics name the API it came in on;
- the run's chat chunks (or its whole chat completion) → the protocol's events (or its
  whole answer), through :mod:`inference.protocols.edge`, which reads a chat stream as the
  parts every protocol builds from (text, a tool call's start and arguments, the finish,
  the usage).

A fourth protocol is a module with those two translations and a view; docs/architecture.md
shows where it plugs in.
"""
