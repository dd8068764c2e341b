//! Loading model weights from any file a user may bring: our safetensors checkpoints,
//! PyTorch's safetensors, and the tutorials' own `torch.save` files.

use std::path::Path;

use anyhow::Context;
use tandem_models::Model;

/// The prefix `DistributedDataParallel` puts before every key of its `state_dict`.
const DDP_PREFIX: &str = "module.";

/// Loads weights into `model` from `path`, choosing the reader by the file's first bytes:
/// a zip archive is a `torch.save` file, anything else is read as safetensors.
pub fn load_weights(model: &mut Model, path: &Path) -> anyhow::Result<()> {
    if is_zip_archive(path)? {
        tandem_models::load_torch_save(model, path, Some(DDP_PREFIX))
            .with_context(|| format!("cannot load weights from {}", path.display()))?;
    } else {
        tandem_models::load_safetensors(model, path)
            .with_context(|| format!("cannot load weights from {}", path.display()))?;
    }
    Ok(())
}

/// Whether the file starts with a zip archive's local-header signature.
fn is_zip_archive(path: &Path) -> anyhow::Result<bool> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open weights file {}", path.display()))?;
    let mut signature = [0u8; 4];
    let read = file
        .read(&mut signature)
        .with_context(|| format!("cannot read weights file {}", path.display()))?;
    Ok(read == 4 && signature == *b"PK\x03\x04")
}
