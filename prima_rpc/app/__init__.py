"""The application: prima-ctl, the HTTP API and its page, local rings and live planning.

It sits above the wire (prima_rpc's stubs, codec, channel and client), nodes/ and solver/; none of those
imports it.
"""
