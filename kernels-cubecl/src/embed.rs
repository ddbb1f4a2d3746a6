//! The embedding lookup of a decode step.

use cubecl::prelude::*;
use half::f16;

use crate::device::{cube_1d, need};
use crate::{DeviceArray, KernelError};

/// `h[t] = table[ids[t]]` widened to f32 (times `scale`, e.g. Gemma's √hidden). Grid `(tokens)`.
#[cube(launch_unchecked)]
pub fn embed_kernel(
    ids: &Array<u32>,
    table: &Array<f16>,
    params: &Array<f32>,
    h: &mut Array<f32>,
    #[comptime] hidden: usize,
) {
    let t = CUBE_POS_X as usize;
    let row = ids[t] as usize * hidden;
    let scale = params[0];
    for c in range_stepped(UNIT_POS as usize, hidden, CUBE_DIM as usize) {
        h[t * hidden + c] = f32::cast_from(table[row + c]) * scale;
    }
}

/// Embedding lookup: `h[t] = table[ids[t]] · params[0]`.
///
/// # Shapes
/// - `ids`: `[tokens]`; `table`: `[vocab, hidden]` f16; `h`: `[tokens, hidden]`
pub fn embed<R: Runtime>(
    client: &ComputeClient<R>,
    tokens: usize,
    hidden: usize,
    ids: &DeviceArray,
    table: &DeviceArray,
    params: &DeviceArray,
    h: &DeviceArray,
) -> Result<(), KernelError> {
    need("embed ids", ids, tokens)?;
    need("embed out", h, tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    // SAFETY: ids are checked against the vocabulary by the caller (the tokenizer's ids); the
    // output was checked above.
    unsafe {
        embed_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            cube_1d(hidden),
            ids.arg(),
            table.arg(),
            params.arg(),
            h.arg(),
            hidden,
        )
    };
    Ok(())
}

/// CPU reference of [`embed`].
pub fn embed_reference(ids: &[u32], table: &[f16], hidden: usize, scale: f32) -> Vec<f32> {
    ids.iter()
        .flat_map(|&i| table[i as usize * hidden..][..hidden].iter().map(move |w| w.to_f32() * scale))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubecl::wgpu::WgpuRuntime;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::testing::{assert_close, client, rand_vec};
    use crate::*;

    #[test]
    fn embed_matches_reference() {
        use half::f16;
        let client = client();
        let mut rng = StdRng::seed_from_u64(99);
        let (hidden, vocab) = (96, 50);
        for tokens in [1usize, 3, 16] {
            let table: Vec<f16> =
                rand_vec(&mut rng, vocab * hidden, 1.0).into_iter().map(f16::from_f32).collect();
            let ids: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..vocab as u32)).collect();
            let h = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * hidden);
            embed(
                &client,
                tokens,
                hidden,
                &DeviceArray::from_slice(&client, &ids),
                &DeviceArray::from_slice(&client, &table),
                &DeviceArray::from_slice(&client, &[2.0f32]),
                &h,
            )
            .unwrap();
            let want = embed_reference(&ids, &table, hidden, 2.0);
            assert_close(&read_f32(&client, &h).unwrap(), &want, 0.0, "embed");
        }
    }
}
