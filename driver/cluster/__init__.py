"""The embedded cluster: a test double of kube-apiserver (the API emulator), and the kubelet simulator.

Used by the demo, the tests and the benchmarks. The product (agent, controller, allocator, inventory,
``driver.kube``) never imports it. It needs the ``demo`` extra (``pip install 'fractional-dra[demo]'``)
for the official schemas it validates with.
"""
