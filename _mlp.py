import jax, jax.numpy as jnp
jax.config.update("jax_platforms","cpu"); jax.config.update("jax_num_cpu_devices",8)
import einshard
W1 = einshard.einshard(jnp.ones((128, 256)), 'x y -> x y*')
W2 = einshard.einshard(jnp.ones((256, 64)), 'y z -> y* z')
X = einshard.einshard(jnp.ones((32, 128)), '... -> * ...')
def mlp(params, x):
    h = jax.nn.relu(x @ params['w1'])
    return h @ params['w2']
print(einshard.explain_step(mlp, {'w1': W1, 'w2': W2}, X, bandwidth=100e9, latency=5e-6, flops_per_second=100e12))
def step(params, x):
    grads = jax.grad(lambda p: jnp.sum(mlp(p, x) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
print(einshard.explain_step(step, {'w1': W1, 'w2': W2}, X))
