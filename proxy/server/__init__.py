"""The llama-server side: the HTTP client and the verify request body, the managed
process and its binary, the checks of an attached server, RPC hosts.

Import the modules themselves (`proxy.server.upstream`); this package re-exports
nothing, so importing one module never loads the others.
"""
