use super::*;

fn arrays(step: u64) -> Arrays {
    Arrays {
        step,
        meta: json!({"ps": 0}),
        arrays: vec![("a".into(), vec![1.0, 2.5]), ("b".into(), vec![-3.0])],
    }
}

#[test]
fn a_parameters_file_is_checked_before_and_replaced_whole() {
    let dir = std::env::temp_dir().join(format!("mpiflow-params-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let path = dir.join("sub").join("params.bin");
    // Before a run: the missing directory is made, and no probe is left in it.
    prepare_params_file(&path).unwrap();
    assert_eq!(fs::read_dir(dir.join("sub")).unwrap().count(), 0);
    let e = prepare_params_file(&dir).unwrap_err().to_string();
    assert_eq!(
        e,
        format!("parameters file {}: is a directory", dir.display())
    );
    // Written, then replaced: only the file itself remains, and it reads back.
    write_params_file(&path, &arrays(10)).unwrap();
    write_params_file(&path, &arrays(20)).unwrap();
    assert_eq!(fs::read_dir(dir.join("sub")).unwrap().count(), 1);
    assert_eq!(read_file(&path, None).unwrap(), arrays(20));
    // A write that fails (its temporary file cannot be made) leaves the earlier file.
    fs::create_dir(beside(&path, "tmp")).unwrap();
    let e = write_params_file(&path, &arrays(30))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!("parameters file {}: ", path.display())),
        "{e}"
    );
    assert_eq!(read_file(&path, None).unwrap(), arrays(20));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let dir = std::env::temp_dir().join(format!("mpiflow-keep-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    // A crash's staging directory before the newest, and one being written after it.
    begin(&dir, 15).unwrap();
    for step in [10, 20, 30, 40] {
        let tmp = begin(&dir, step).unwrap();
        let (b, c) = write_file(&tmp.join("f.bin"), &arrays(step)).unwrap();
        commit(&dir, step, &[("f.bin".into(), b, c)], json!({})).unwrap();
    }
    begin(&dir, 50).unwrap();
    retain(&dir, 0);
    assert_eq!(listed(&dir).len(), 4, "0 keeps all");
    retain(&dir, 2);
    let steps: Vec<u64> = listed(&dir).iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [40, 30]);
    assert!(!staging_dir(&dir, 15).exists());
    assert!(
        staging_dir(&dir, 50).exists(),
        "a newer one is being written"
    );
    assert_eq!(latest(&dir).0.unwrap().step, 40);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_commit_verify_and_fall_back_on_corruption() {
    let dir = std::env::temp_dir().join(format!("mpiflow-ckpt-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for step in [100, 200] {
        let tmp = begin(&dir, step).unwrap();
        let (b, c) = write_file(&tmp.join("shard-ps0.bin"), &arrays(step)).unwrap();
        commit(&dir, step, &[("shard-ps0.bin".into(), b, c)], json!({})).unwrap();
    }
    let (found, warns) = latest(&dir);
    assert_eq!(found.as_ref().unwrap().step, 200);
    assert!(warns.is_empty());
    let back = read_file(&found.unwrap().path.join("shard-ps0.bin"), None).unwrap();
    assert_eq!(back, arrays(200));
    // Flip one byte of the newest: it is reported and the previous one used.
    let f = dir.join("ckpt-200/shard-ps0.bin");
    let mut bytes = fs::read(&f).unwrap();
    bytes[30] ^= 1;
    fs::write(&f, bytes).unwrap();
    let (found, warns) = latest(&dir);
    assert_eq!(found.unwrap().step, 100);
    assert!(
        warns[0].contains("ckpt-200") && warns[0].contains("corrupted"),
        "{warns:?}"
    );
    // An incomplete one (no manifest, as a crash before commit leaves a staging dir,
    // or a stray directory) is skipped too.
    fs::create_dir_all(dir.join("ckpt-300")).unwrap();
    let (found, warns) = latest(&dir);
    assert_eq!(found.unwrap().step, 100);
    assert!(warns[0].contains("incomplete"));
    // Truncated file.
    let g = dir.join("ckpt-100/shard-ps0.bin");
    let bytes = fs::read(&g).unwrap();
    fs::write(&g, &bytes[..bytes.len() - 3]).unwrap();
    assert!(latest(&dir).0.is_none());
    fs::remove_dir_all(&dir).unwrap();
}
