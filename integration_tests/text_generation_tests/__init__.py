"""Client-side tests of an `fmaas.GenerationService` server (TGIS's integration_tests package).

`text_generation_tests.pb` holds the stubs `make gen-client` generates from
`../proto/generation.proto`; they are not committed.
"""
